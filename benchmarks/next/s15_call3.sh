#!/usr/bin/env bash
# Session 15, call 3: issue 15, co-residence with the GEMMs placed first (a high-priority stream), DeepSeek-V3 then gpt-oss.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s15c3; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${MOE_S:-150} python3 benchmarks/next/moe_cohabit.py $R ${SHAPES:-deepseek-v3} 10 ${ONLY:-pair,gemms,convert_a4b32w2_p3,co_} >> $R/call.log 2>&1
echo "cohabit rc=$?" | tee -a $R/call.log
date -u | tee -a $R/call.log
