#!/usr/bin/env bash
# Session 15, call 8: issue 15, the GEMMs beside a copy held to at most LIMIT programs an SM (COHAB_LIMITED=1).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s15c8; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${MOE_S:-150} env COHAB_LIMITED=1 COHAB_PARTS=${COHAB_PARTS:-copy} python3 benchmarks/next/cohab_spin.py $R >> $R/call.log 2>&1
echo "cohabit rc=$?" | tee -a $R/call.log
date -u | tee -a $R/call.log
