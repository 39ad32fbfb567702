#!/usr/bin/env bash
# Session 13, call 6 (issue 16): the gpu tests of the new batch-1 default alone, b1_chain.py (the new default against
# the chain before, in turns), then more acceptance rounds of the defaults (decode cases).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s13c6; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "tests/kernels/test_sparse_mla_gluon.py::test_gluon_kernel_is_the_batch1_default_with_its_slices_merged_at_once" \
  "tests/kernels/test_sparse_mla_gluon.py::test_gluon_deepseek_v32_shape_matches_twin[options0]" \
  "tests/kernels/test_sparse_mla_gluon.py::test_gluon_deepseek_v32_shape_matches_twin[options1]" \
  "tests/kernels/test_sparse_mla_gluon.py::test_gluon_decode_batch64_matches_twin[options0]" \
  "tests/kernels/test_sparse_mla_gluon.py::test_gluon_decode_batch64_matches_twin[options1]" \
  tests/kernels/test_sparse_mla.py::test_combine_all_slices_at_once_matches_the_slice_loop > $R/pytest_gpu.log 2>&1
echo "rc=$?" >> $R/pytest_gpu.log; tail -4 $R/pytest_gpu.log
timeout 100 python3 benchmarks/next/b1_chain.py $R ${ROUNDS:-3} > $R/b1_chain.log 2>&1
echo "chain rc=$?"; grep -A20 '^{$' $R/b1_chain.log
for r in $(seq 1 ${ACC_ROUNDS:-3}); do
  A=/tmp/acc_new_$r
  timeout 90 python3 -m adapt.stages.bench_dsa --out $A --acceptance --no-sweep --no-prefill > $A.log 2>&1
  echo "new $r rc=$?"; grep -E "step us per layer|position splits|^\| 1 \| 131072" $A/dsa_bench.md | head -4
  { echo "=== new round $r"; cat $A/dsa_bench.md; tail -3 $A.log; } >> $R/acceptance.md
done
date -u
