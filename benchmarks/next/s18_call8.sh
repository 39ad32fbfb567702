#!/usr/bin/env bash
# Session 18, call 8 (issue 16): the warp-specialised indexer kernel at 4 and 8 rows (ws4 now the sm_90 default):
# gpu tests, index_wg.py (ws4 / ws8 at 3-6 stages against the 2-row kernel), then the full acceptance at main's
# defaults; SM clock and power logged.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s18c8}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 500 > $R/smi.csv 2>&1 &
SMI=$!
timeout ${TEST_S:-120} python3 -m pytest -q -m gpu -p no:cacheprovider \
  -k "match_twin or deepseek_shapes or deepseek_v32_shapes or padded_tile" \
  tests/kernels/test_dsa_gluon.py tests/kernels/test_dsa.py > $R/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|FAILED" $R/pytest.log | head -8
grep -q "FAILED.*ws8" $R/pytest.log && export INDEX_WG_SKIP=ws8
timeout ${PROBE_S:-100} python3 benchmarks/next/index_wg.py $R ${ROUNDS:-2} ${BUDGET:-80} > $R/index_wg.log 2>&1
echo "probe rc=$?"; grep -v '^{"variant"' $R/index_wg.log | tail -18
timeout ${ACC_S:-170} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep > $R/dsa.log 2>&1
echo "acceptance rc=$?"; grep -E "MET|prefill T|decode  B|^ *[0-9]+ x|131072" $R/dsa.log | tail -14
kill $SMI
date -u
