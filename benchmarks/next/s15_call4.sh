#!/usr/bin/env bash
# Session 15, call 4 (and 5, with the copy rows): issue 15, whether small blocks of another kernel share SMs with the capped GEMMs (cohab_spin.py).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s15c4; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${MOE_S:-150} python3 benchmarks/next/cohab_spin.py $R >> $R/call.log 2>&1
echo "cohabit rc=$?" | tee -a $R/call.log
date -u | tee -a $R/call.log
