#!/usr/bin/env bash
# Session 13, call 2 (issue 16, batch-1 decode): gpu tests of the zeroing in the scoring kernel and the combine,
# b1_chain.py (the step taken apart; the two switches in turn), then the acceptance's decode cases in turns: the
# defaults (counters zeroed by the scoring kernel, combine at once) against session 12's chain.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s13c2; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -k "combine or zeroes_the_grid or decode_scores_and_topk or grid_select" \
  tests/kernels/test_sparse_mla.py tests/kernels/test_dsa.py tests/kernels/test_topk.py > $R/pytest_gpu.log 2>&1
echo "rc=$?" >> $R/pytest_gpu.log; tail -4 $R/pytest_gpu.log
timeout 200 python3 benchmarks/next/b1_chain.py $R ${ROUNDS:-5} > /tmp/b1_chain.log 2>&1
echo "chain rc=$?"; cat /tmp/b1_chain.log >> $R/pytest_gpu.log; grep -A30 '^{$' /tmp/b1_chain.log
for r in $(seq 1 ${ACC_ROUNDS:-3}); do
  for v in new old; do
    if [ $v = new ]; then flags=""; else flags="--no-grid-zero-in-scores --no-combine-at-once"; fi
    A=/tmp/acc_${v}_$r
    timeout 120 python3 -m adapt.stages.bench_dsa --out $A --acceptance --no-sweep --no-prefill $flags > $A.log 2>&1
    echo "$v $r rc=$?"; grep -E "step us per layer" $A/dsa_bench.md | head -2
    { echo "=== $v round $r ($flags)"; cat $A/dsa_bench.md; tail -3 $A.log; } >> $R/acceptance.md
  done
done
date -u
