#!/usr/bin/env bash
# Session 11, call 5 (issue 15): GEMM1 prefetching GEMM2's words into L2 (PlanarConfig.l2_next): its gpu test, then
# benchmarks/next/moe_l2.py (both shapes, T = 1 / 16 / 64, GEMM1's l2_next 0.4 / 0.7 / 1.0 against the table).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s11c5; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout 90 python3 -m pytest -q -p no:cacheprovider -k "l2_next" tests/kernels/test_moe.py > $R/pytest_gpu_l2.log 2>&1
echo "rc=$?" >> $R/pytest_gpu_l2.log; tail -3 $R/pytest_gpu_l2.log
timeout "${PROBE_S:-300}" python3 benchmarks/next/moe_l2.py $R/moe_l2.json > $R/moe_l2.log 2>&1; echo "probe rc=$?"
tail -12 $R/moe_l2.log
date -u
