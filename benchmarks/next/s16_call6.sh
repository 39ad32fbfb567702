#!/usr/bin/env bash
# Session 16, call 6: the prefill acceptance case at the session's final defaults (upconvert, COPY_ROWS4, DEFER_SUM).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s16c6; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${ACC_S:-150} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep --prefill-only > $R/dsa.log 2>&1
echo "dsa rc=$?" | tee -a $R/call.log; tail -12 $R/dsa.log
rm -f $R/acc/dsa_report.json
date -u | tee -a $R/call.log
