#!/usr/bin/env bash
# Session 13, call 7 (issue 16): b1_chain.py (combine program sizes; the new default against
# the chain before, in turns), then more acceptance rounds of the defaults (decode cases).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s13c7; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout 100 python3 benchmarks/next/b1_chain.py $R ${ROUNDS:-3} > $R/b1_chain.log 2>&1
echo "chain rc=$?"; grep -A20 '^{$' $R/b1_chain.log
for r in $(seq 1 ${ACC_ROUNDS:-3}); do
  A=/tmp/acc_new_$r
  timeout 90 python3 -m adapt.stages.bench_dsa --out $A --acceptance --no-sweep --no-prefill > $A.log 2>&1
  echo "new $r rc=$?"; grep -E "step us per layer|position splits|^\| 1 \| 131072" $A/dsa_bench.md | head -4
  { echo "=== new round $r"; cat $A/dsa_bench.md; tail -3 $A.log; } >> $R/acceptance.md
done
date -u
