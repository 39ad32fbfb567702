#!/usr/bin/env bash
# Session 16, call 1: issue 16 prefill, sparse MLA over an upconverted (dense bf16) cache: the GPU tests of
# tests/kernels/test_sparse_mla_upconvert.py, then benchmarks/next/mla_upconvert.py.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s16c1; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${TESTS_S:-150} python3 -m pytest -q -x -m gpu tests/kernels/test_sparse_mla_upconvert.py -p no:cacheprovider > $R/pytest.log 2>&1
echo "pytest rc=$?" | tee -a $R/call.log; tail -15 $R/pytest.log
timeout ${PROBE_S:-240} python3 benchmarks/next/mla_upconvert.py $R ${ROUNDS:-2} > $R/probe.log 2>&1
echo "probe rc=$?" | tee -a $R/call.log; tail -30 $R/probe.log
date -u | tee -a $R/call.log
# the prefill acceptance case (128K: indexer, top-k, sparse MLA, against dense SDPA) with the upconvert rule on
timeout ${ACC_S:-240} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep --prefill-only --mla-upconvert > $R/dsa.log 2>&1
echo "dsa rc=$?" | tee -a $R/call.log; tail -25 $R/dsa.log
date -u | tee -a $R/call.log
