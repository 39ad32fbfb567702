#!/usr/bin/env bash
# Session 14, call 2 (issue 16, batch 1): gpu tests of the new options (the Gluon sparse MLA's PDL and bf16
# partials, the grid select's candidate list loaded once), b1_step.py (the step under each option, in turns), then
# Nsight Compute's SASS stall samples of the select, sparse MLA and combine kernels.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s14c2; mkdir -p $R
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "tests/kernels/test_sparse_mla_gluon.py::test_batch1_chain_options_pdl_and_bf16_partials" \
  "tests/kernels/test_sparse_mla_gluon.py::test_gluon_kernel_is_the_batch1_default_with_its_slices_merged_at_once" \
  "tests/kernels/test_sparse_mla.py::test_combine_all_slices_at_once_matches_the_slice_loop" \
  "tests/kernels/test_topk.py::test_grid_select_candidates_loaded_once_past_the_first_block" \
  "tests/kernels/test_topk.py::test_grid_select_deepseek_v32_decode_shape_on_gpu" >> $R/call.log 2>&1
echo "tests rc=$?" | tee -a $R/call.log; tail -3 $R/call.log
timeout 200 python3 benchmarks/next/b1_step.py $R ${ROUNDS:-5} >> $R/call.log 2>&1
echo "step rc=$?"; grep -A40 '^{$' $R/call.log | head -45; grep -E '^(default|mla|partials|select|pdl)' $R/call.log
if [ -n "$NCU" ]; then
  timeout 200 $NCU --clock-control none --set full --import-source no -k 'regex:grid_select|mla|combine' \
    --launch-skip 9 --launch-count 3 --export /tmp/b1rep2 -f python3 benchmarks/next/b1_ncu.py 6 >> $R/call.log 2>&1
  echo "ncu rc=$?"
  $NCU --import /tmp/b1rep2.ncu-rep --page source --csv --print-source sass > /tmp/src2.csv 2>> $R/call.log
  python3 benchmarks/next/ncu_top.py /tmp/src2.csv 60 > $R/ncu_top.txt 2>&1
  $NCU --import /tmp/b1rep2.ncu-rep --page details > $R/ncu_details.txt 2>&1
fi
date -u | tee -a $R/call.log
