#!/usr/bin/env bash
# Session 13, call 3 (issue 16, batch-1 decode): gpu tests of the slices merged inside the sparse MLA kernel, then
# b1_chain.py (parts; combine launch against the merge in the kernel, in turn), then the acceptance's decode cases
# in turns: the defaults against --merge-in-kernel.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s13c3; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -k "merged_in_the_kernel or combine" \
  tests/kernels/test_sparse_mla.py > $R/pytest_gpu.log 2>&1
echo "rc=$?" >> $R/pytest_gpu.log; tail -4 $R/pytest_gpu.log
if grep -q "passed" $R/pytest_gpu.log && ! grep -q "failed" $R/pytest_gpu.log; then
  timeout 200 python3 benchmarks/next/b1_chain.py $R ${ROUNDS:-5} > /tmp/b1_chain.log 2>&1
  echo "chain rc=$?"; cat /tmp/b1_chain.log >> $R/pytest_gpu.log; grep -A30 '^{$' /tmp/b1_chain.log
  for r in $(seq 1 ${ACC_ROUNDS:-3}); do
    for v in base merge; do
      if [ $v = base ]; then flags="--no-merge-in-kernel"; else flags="--merge-in-kernel"; fi
      A=/tmp/acc_${v}_$r
      timeout 120 python3 -m adapt.stages.bench_dsa --out $A --acceptance --no-sweep --no-prefill $flags > $A.log 2>&1
      echo "$v $r rc=$?"; grep -E "step us per layer|sparse MLA decode TFLOP" $A/dsa_bench.md | head -3
      { echo "=== $v round $r ($flags)"; cat $A/dsa_bench.md; tail -3 $A.log; } >> $R/acceptance.md
    done
  done
fi
date -u
