#!/usr/bin/env bash
# Session 14, call 4 (issue 16): the acceptance harness (decode cases, no sweep) with the decode step timed in steady
# state (replays back to back; the synced per-replay figure beside it): batches 1 and 64 once, then batch 1 twice.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s14c4; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
run() {  # name, batches
  local A=/tmp/acc_$1
  timeout 200 python3 -m adapt.stages.bench_dsa --out $A --acceptance --no-sweep --no-prefill --decode-batches $2 > $A.log 2>&1
  echo "$1 rc=$?"; grep -E "step us per layer|step / byte|sparse MLA decode TF|graph of 8 layers \(own|with a sync after|^\| (1|64) \| 131072" $A/dsa_bench.md | head -9
  { echo "=== $1"; cat $A/dsa_bench.md; tail -3 $A.log; } >> $R/acceptance.md
  cp $A/dsa_bench.json $R/dsa_bench_$1.json
}
run both 1,64
run b1a 1
run b1b 1
date -u | tee -a $R/call.log
