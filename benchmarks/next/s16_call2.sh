#!/usr/bin/env bash
# Session 16, call 2: the bf16 sparse MLA kernel's EARLY_WAIT against its default (GPU tests, then
# benchmarks/next/mla_upconvert.py, 3 rounds).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s16c2; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${TESTS_S:-150} python3 -m pytest -q -x -m gpu tests/kernels/test_sparse_mla_upconvert.py -p no:cacheprovider > $R/pytest.log 2>&1
echo "pytest rc=$?" | tee -a $R/call.log; tail -5 $R/pytest.log
timeout ${PROBE_S:-240} python3 benchmarks/next/mla_upconvert.py $R ${ROUNDS:-3} > $R/probe.log 2>&1
echo "probe rc=$?" | tee -a $R/call.log; cat $R/probe.log | cut -c1-220
date -u | tee -a $R/call.log
