#!/usr/bin/env bash
# Session 18, call 2 (issue 16): the indexer's key tile in registers (REG_A) and key splits for the chunk tails,
# against the default (index_wg.py), then the prefill acceptance with REG_A on; SM clock, power and throttle
# reasons logged every 500 ms through both (the acceptance ran 855 where the probe ran 900 in call 1).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s18c2}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 500 > $R/smi.csv 2>&1 &
SMI=$!
T=tests/kernels/test_dsa_gluon.py
timeout 90 python3 -m pytest -q -x -m gpu -p no:cacheprovider "$T::test_gluon_scores_match_twin_on_gpu[opts17]" \
  "$T::test_gluon_scores_match_twin_on_gpu[opts18]" > $R/pytest_rega.log 2>&1
rc=$?; echo "pytest reg_a rc=$rc"; tail -2 $R/pytest_rega.log
[ $rc = 0 ] || export INDEX_WG_SKIP=reg_a
echo "probe start $(date -u +%T)"
timeout ${PROBE_S:-150} python3 benchmarks/next/index_wg.py $R ${ROUNDS:-3} ${BUDGET:-120} > $R/index_wg.log 2>&1
echo "probe rc=$? end $(date -u +%T)"; grep -v '^{"variant"' $R/index_wg.log | tail -20
if [ "${ACC_S:-200}" != 0 ]; then
  echo "acceptance start $(date -u +%T)"
  timeout ${ACC_S:-200} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep --prefill-only \
    ${ACC_FLAGS:---prefill-reg-a} > $R/dsa.log 2>&1
  echo "acceptance rc=$? end $(date -u +%T)"; grep -E "MET|prefill T|^ *[0-9]+ x|131072" $R/dsa.log | tail -8
fi
kill $SMI
python3 - $R/smi.csv <<'PY'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 4]
busy = [r for r in rows if r[2].split()[0].replace(".", "").isdigit() and float(r[2].split()[0]) > 300]
if busy:
    clk = sorted(int(r[1].split()[0]) for r in busy)
    pw = sorted(float(r[2].split()[0]) for r in busy)
    print(f"smi: {len(busy)} busy samples; SM MHz min {clk[0]} median {clk[len(clk)//2]}; W median {pw[len(pw)//2]} max {pw[-1]}")
    print("reasons:", sorted({r[4].strip() for r in busy}))
PY
date -u
