#!/usr/bin/env bash
# Session 20, call 7 (issue 16): the closing check at main's defaults: every GPU test of the Gluon sparse MLA
# (the new F16 and GATHER_ROWS cases among them, and the warp-specialised form that now takes F16), then the full
# acceptance (`--no-sweep`). About 450 s of command. CALL=s20c7 ADAPT_COMMIT=<sha> OUT=$OUT bash ...
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s20c7}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout ${TEST_S:-230} python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sparse_mla_gluon.py \
  > $R/tests.log 2>&1
echo "tests rc=$? $(date -u +%T)" >> $R/runs.txt
tail -4 $R/tests.log
timeout ${ACC_S:-300} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep \
  --prefill-selects auto > $R/dsa.log 2>&1
echo "acc rc=$? $(date -u +%T)" >> $R/runs.txt
cp $R/acc/dsa_report.md $R/dsa_report.md 2>/dev/null
grep -E "^ *(NOT )?MET" $R/dsa.log
cat $R/runs.txt
date -u
