#!/usr/bin/env bash
# Session 18, call 7 (issue 16): the two-warpgroup 4-row indexer kernel (ws4): its gpu tests against the twin and the
# tl kernel, then index_wg.py (ws4 at 2-6 stages, with and without the carry, against the default), then the
# prefill acceptance with --prefill-ws4; SM clock and power logged.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s18c7}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 500 > $R/smi.csv 2>&1 &
SMI=$!
T=tests/kernels/test_dsa_gluon.py
timeout ${TEST_S:-150} python3 -m pytest -q -x -m gpu -p no:cacheprovider "$T::test_gluon_scores_match_twin_on_gpu[opts19]" \
  "$T::test_gluon_scores_match_twin_on_gpu[opts20]" "$T::test_gluon_scores_match_twin_on_gpu[opts21]" \
  "$T::test_gluon_scores_at_deepseek_shapes_on_gpu[ws4]" > $R/pytest_ws4.log 2>&1
rc=$?; echo "pytest ws4 rc=$rc"; grep -E "passed|failed|Error|assert" $R/pytest_ws4.log | head -8
if [ $rc = 0 ]; then
  timeout ${PROBE_S:-200} python3 benchmarks/next/index_wg.py $R ${ROUNDS:-3} ${BUDGET:-170} > $R/index_wg.log 2>&1
  echo "probe rc=$?"; grep -v '^{"variant"' $R/index_wg.log | tail -20
  timeout ${ACC_S:-150} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep --prefill-only --prefill-ws4 \
    > $R/dsa.log 2>&1
  echo "acceptance ws4 rc=$?"; grep -E "MET|prefill T|131072" $R/dsa.log | grep -v "decode" | tail -5
fi
kill $SMI
date -u
