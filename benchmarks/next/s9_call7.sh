#!/usr/bin/env bash
# Session 9, call 7 (issue 16): sparse MLA decode tile ablations (benchmarks/next/mla_ablate.py). One tgz under $OUT.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. ADAPT_COMMIT=${ADAPT_COMMIT:-unknown}
R=$OUT/s9c7; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; echo "commit $ADAPT_COMMIT"; } > $R/env.txt 2>&1
timeout 240 python3 benchmarks/next/mla_ablate.py $R 0,1,2 64,32 > $R/mla_ablate.log 2>&1; echo "rc=$?" >> $R/mla_ablate.log
cat $R/mla_ablate.log
tar czf $OUT/s9c7.tgz -C $OUT s9c7
