#!/usr/bin/env bash
# Session 13, call 4 (issue 16, batch-1 decode): b1_chain.py with sparse MLA options at batch 1 (more programs:
# 64-position tiles in 32 slices, 32-head blocks, the Gluon kernel), alone and in the step, in turns.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s13c4; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout 300 python3 benchmarks/next/b1_chain.py $R ${ROUNDS:-4} > $R/b1_chain.log 2>&1
echo "chain rc=$?"; grep -A40 '^{$' $R/b1_chain.log; grep -i "error" $R/b1_chain.log | head -5
date -u
