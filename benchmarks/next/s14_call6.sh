#!/usr/bin/env bash
# Session 14, call 6 (issue 16): gpu tests of this session's DSA changes, then the whole acceptance (decode and
# prefill, no sweep; the decode step timed back to back, library defaults in the step).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s14c6; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "tests/kernels/test_topk.py::test_grid_select_deepseek_v32_decode_shape_on_gpu" \
  "tests/kernels/test_topk.py::test_grid_select_candidates_loaded_once_past_the_first_block" \
  "tests/kernels/test_sparse_mla_gluon.py::test_batch1_chain_options_pdl_and_bf16_partials" \
  "tests/kernels/test_sparse_mla_gluon.py::test_gluon_kernel_is_the_batch1_default_with_its_slices_merged_at_once" \
  >> $R/call.log 2>&1
echo "tests rc=$?" | tee -a $R/call.log; grep -E "passed|failed" $R/call.log | tail -2
timeout 330 python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep --prefill-selects auto > $R/acc.log 2>&1
echo "acceptance rc=$?"; grep -E "^\| (decode|sparse|indexer|prefill)|graph of 8 layers \(own|with a sync after|^\| (1|64) \| 131072" $R/acc/dsa_bench.md | head -20
date -u | tee -a $R/call.log
