#!/usr/bin/env bash
# Session 19, call 3 (issue 15): gpu tests of the planar chain's two changes (the fused combine's sum set first,
# GEMM2's early L2 prefetch), then moe_kernels.py (kernels with PDL off; former / zero_first / early_l2 in turns) at
# T = 1, 16, 64 of both shapes. About 150 s of command.
# CALL=s19c3 ADAPT_COMMIT=<sha> OUT=$OUT bash benchmarks/next/s19_call3.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s19c3}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 500 > $R/smi.csv 2>&1 &
SMI=$!
timeout ${TEST_S:-90} python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -k "zero_first or l2_next or planar_moe" tests/kernels/test_moe.py > $R/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" $R/pytest.log | head -8
timeout ${MOE_S:-200} python3 benchmarks/next/moe_kernels.py $R/moe_kernels.json ${TOKENS:-1 16 64} > $R/moe_kernels.log 2>&1
echo "moe_kernels rc=$?"; grep -v Warning $R/moe_kernels.log | cut -c1-330 | tail -40
kill $SMI
date -u
