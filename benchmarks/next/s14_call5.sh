#!/usr/bin/env bash
# Session 14, call 5 (issue 16): the acceptance harness (decode cases, steady step timing, library defaults in the
# step) on batches 1 and 64, batch 1 twice more; gpu tests of the grid select with 2 / 4 programs an SM; b1_step.py
# (the select's programs an SM and its candidate list loaded once, in turns).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s14c5; mkdir -p $R
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
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "tests/kernels/test_topk.py::test_grid_select_deepseek_v32_decode_shape_on_gpu" >> $R/call.log 2>&1
echo "tests rc=$?"; tail -1 $R/call.log
timeout 200 python3 benchmarks/next/b1_step.py $R ${ROUNDS:-5} > $R/b1_step.log 2>&1
echo "step rc=$?"; grep -A30 '^{$' $R/b1_step.log | head -30; grep -E '^(default|select)' $R/b1_step.log
date -u | tee -a $R/call.log
