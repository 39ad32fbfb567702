#!/usr/bin/env bash
# Session 13, call 5 (issue 16, batch-1 decode): gpu tests of the new batch-1 default (the Gluon sparse MLA kernel
# in 32 slices, the combine at once), then the acceptance's decode cases in turns: the new defaults against
# --no-mla-gluon-sliced --no-combine-at-once (the chain before).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s13c5; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -k "batch1_default or deepseek_v32_shape or combine or decode_batch64_matches_twin and not ws and not lazy and not w16 and not l2" \
  tests/kernels/test_sparse_mla_gluon.py tests/kernels/test_sparse_mla.py > $R/pytest_gpu.log 2>&1
echo "rc=$?" >> $R/pytest_gpu.log; tail -4 $R/pytest_gpu.log
for r in $(seq 1 ${ACC_ROUNDS:-3}); do
  for v in new old; do
    if [ $v = new ]; then flags=""; else flags="--no-mla-gluon-sliced --no-combine-at-once"; fi
    A=/tmp/acc_${v}_$r
    timeout 120 python3 -m adapt.stages.bench_dsa --out $A --acceptance --no-sweep --no-prefill $flags > $A.log 2>&1
    echo "$v $r rc=$?"; grep -E "step us per layer|sparse MLA decode TFLOP|batch 64 x 128K: step" $A/dsa_bench.md | head -4
    { echo "=== $v round $r ($flags)"; cat $A/dsa_bench.md; tail -3 $A.log; } >> $R/acceptance.md
  done
done
date -u
