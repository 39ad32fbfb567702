#!/usr/bin/env bash
# Session 15, call 1: issue 15 at T = 16384, the workspace conversion co-resident with register-capped GEMMs
# (FP8Workspace schedule "cohabit", benchmarks/next/moe_cohabit.py), both shapes; then the schedule's gpu test.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s15c1; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${BENCH_S:-300} python3 benchmarks/next/moe_cohabit.py $R ${SHAPES:-deepseek-v3,gpt-oss-120b} ${REPS:-10} >> $R/call.log 2>&1
echo "cohabit rc=$?" | tee -a $R/call.log
timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider "tests/kernels/test_moe.py::test_workspace_schedules_match_offline" >> $R/call.log 2>&1
echo "tests rc=$?" | tee -a $R/call.log; tail -3 $R/call.log
date -u | tee -a $R/call.log
