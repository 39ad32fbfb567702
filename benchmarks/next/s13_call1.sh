#!/usr/bin/env bash
# Session 13, call 1 (issue 16, batch-1 decode): gpu tests of the slice combine's two forms and the grid select,
# then b1_select.py (the selects incl. the packed grid, the combine at once against one slice after the other,
# sparse MLA slices, eager profiles), then the acceptance's decode cases in turns: the defaults, and the grid
# select with packed reductions.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s13c1; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}";
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $R/env.txt 2>&1
cat $R/env.txt
if [ "${TESTS_S:-100}" != 0 ]; then
  timeout "${TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider -m gpu -k "combine or twin_and_reference or grid" \
    tests/kernels/test_sparse_mla.py tests/kernels/test_topk.py > $R/pytest_gpu.log 2>&1
  echo "rc=$?" >> $R/pytest_gpu.log; tail -4 $R/pytest_gpu.log
fi
if [ "${B1_S:-150}" != 0 ]; then
  timeout "${B1_S:-150}" python3 benchmarks/next/b1_select.py $R/b1 > $R/b1_select.log 2>&1
  echo "b1 rc=$?"; grep -A200 '^{$' $R/b1_select.log | head -80
fi
for r in $(seq 1 ${ROUNDS:-2}); do
  timeout 120 python3 -m adapt.stages.bench_dsa --out $R/acc_def_$r --acceptance --no-sweep --no-prefill > $R/acc_def_$r.log 2>&1
  echo "def $r rc=$?"; grep -E "^\| 1 \||^\| 64 \||step us per layer|position splits" $R/acc_def_$r/dsa_bench.md | head -8
  timeout 120 python3 -m adapt.stages.bench_dsa --out $R/acc_packed_$r --acceptance --no-sweep --no-prefill \
    --few-rows-select grid --few-rows-options '{"num_warps": 8, "packed": true}' > $R/acc_packed_$r.log 2>&1
  echo "packed $r rc=$?"; grep -E "^\| 1 \||^\| 64 \||step us per layer|position splits" $R/acc_packed_$r/dsa_bench.md | head -8
done
date -u
