#!/usr/bin/env bash
# Session 15, call 2: (1) issue 15's co-residence diagnostic at T = 16384 (moe_cohabit.py: GEMMs and conversion on two
# streams with no dependency, beside each alone), DeepSeek-V3; (2) issue 16's decode acceptance (batch 1 and 64) with
# the component columns timed back to back like the step.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s15c2; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${MOE_S:-150} python3 benchmarks/next/moe_cohabit.py $R deepseek-v3 10 pair,gemms,convert_a4b32w2 >> $R/call.log 2>&1
echo "cohabit rc=$?" | tee -a $R/call.log
timeout ${DSA_S:-240} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep --no-prefill --decode-batches 1,64 > $R/dsa.log 2>&1
echo "dsa rc=$?" | tee -a $R/call.log; tail -30 $R/dsa.log
date -u | tee -a $R/call.log
