#!/usr/bin/env bash
# Session 11, call 3 (issue 15): PDL on the planar MoE chain (tile map, planar GEMMs, split-K epilogue, combine):
# the planar gpu tests with PDL on (the default on sm_90), then benchmarks/next/moe_pdl.py (off / on in turns, both
# shapes, T = 1..1024).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s11c3; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout "${TESTS_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider -k "planar" tests/kernels/test_moe.py tests/kernels/test_moe_stream_k.py \
  > $R/pytest_gpu_planar.log 2>&1; echo "rc=$?" >> $R/pytest_gpu_planar.log; tail -3 $R/pytest_gpu_planar.log
timeout "${PROBE_S:-300}" python3 benchmarks/next/moe_pdl.py $R/moe_pdl.json > $R/moe_pdl.log 2>&1; echo "probe rc=$?"
cat $R/moe_pdl.log | tail -20
date -u
