#!/usr/bin/env bash
# Session 17, call 2 (issue 16, indexer prefill): the gpu tests that run prefill scoring (now the one-warpgroup
# Gluon kernel with the carried epilogue by default on sm_90), index_wg.py (stages of the winner, against tl and the
# default, chunks as bench_dsa's all-rows measure), then the prefill acceptance case with the new default and with
# the tl tile (--prefill-gluon-wg 0).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s17c2; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
if [ "${TEST_S:-200}" != 0 ]; then
  timeout ${TEST_S:-200} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernels/test_dsa_gluon.py \
    tests/kernels/test_dsa.py tests/kernels/test_dsa_prefill.py > $R/pytest.log 2>&1
  echo "pytest rc=$?"; tail -5 $R/pytest.log
fi
if [ "${PROBE_S:-120}" != 0 ]; then
  timeout ${PROBE_S:-120} python3 benchmarks/next/index_wg.py $R ${ROUNDS:-3} ${BUDGET:-100} > $R/index_wg.log 2>&1
  echo "probe rc=$?"; grep -v '^{"variant"' $R/index_wg.log | tail -20
fi
for g in ${ACC_GROUPS:-1 0}; do
  timeout ${ACC_S:-170} python3 -m adapt.stages.bench_dsa --out $R/acc_wg$g --acceptance --no-sweep --prefill-only \
    --prefill-gluon-wg $g > $R/dsa_wg$g.log 2>&1
  echo "acceptance wg$g rc=$?"; grep -iE "prefill|index|speedup|dense" $R/dsa_wg$g.log | tail -8
done
date -u
