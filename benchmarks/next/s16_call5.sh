#!/usr/bin/env bash
# Session 16, call 5: the bf16 sparse MLA kernel's COPY_ROWS4 (GPU test of the upconvert file, mla_upconvert.py, 2 rounds).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s16c5; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${TESTS_S:-120} python3 -m pytest -q -x -m gpu tests/kernels/test_sparse_mla_upconvert.py -p no:cacheprovider > $R/pytest.log 2>&1
echo "pytest rc=$?" | tee -a $R/call.log; tail -4 $R/pytest.log
timeout ${PROBE_S:-150} python3 benchmarks/next/mla_upconvert.py $R ${ROUNDS:-2} > $R/probe.log 2>&1
echo "probe rc=$?" | tee -a $R/call.log; cut -c1-200 $R/probe.log
date -u | tee -a $R/call.log
