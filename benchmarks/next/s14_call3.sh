#!/usr/bin/env bash
# Session 14, call 3 (issue 16, batch 1): b1_clock.py (the timer after idle, warmed, batched; SM clocks), then the
# acceptance harness's batch-1 case (decode only, no sweep) five times: A the step with the sweeps' picks (as before
# this session), B the defaults, C the defaults with the timer warmed (ADAPT_TIMER_WARM_MS=20), then B and C again.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s14c3; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout 120 python3 benchmarks/next/b1_clock.py $R >> $R/call.log 2>&1; echo "clock rc=$?"
grep '^{' $R/call.log | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['trial'], r['what'], r['clock_idle'], r['clock_after_cold'], r['clock_end'], 'cold', round(r['cold_10_sync'],2), r['cold_first_last'], 'warm', round(r['warm_10_sync'],2), round(r['warm_100_sync'],2), 'batched', round(r['batched_200'],2), 'tc', round(r['time_cuda_100'],2))"
run() {  # name, extra args, env
  local name=$1; shift
  local A=/tmp/acc_$name
  env "$@" timeout 150 python3 -m adapt.stages.bench_dsa --out $A --acceptance --no-sweep --no-prefill --decode-batches 1 \
    ${FLAGS:-} > $A.log 2>&1
  echo "$name rc=$?"; grep -E "step us per layer|indexer programs|position splits|^\| 1 \| 131072" $A/dsa_bench.md | head -5
  { echo "=== $name"; cat $A/dsa_bench.md; tail -3 $A.log; } >> $R/acceptance.md
}
FLAGS=--step-swept-tiles run A1 ADAPT_TIMER_WARM_MS=0
FLAGS= run B1 ADAPT_TIMER_WARM_MS=0
FLAGS= run C1 ADAPT_TIMER_WARM_MS=20
FLAGS= run B2 ADAPT_TIMER_WARM_MS=0
FLAGS= run C2 ADAPT_TIMER_WARM_MS=20
date -u | tee -a $R/call.log
