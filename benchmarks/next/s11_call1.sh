#!/usr/bin/env bash
# Session 11, call 1 (issue 15): the runtime's MXFP4 layer now holds only the planar copy. GPU tests of the
# conversion from it (bit-equal to the word conversion at the real shapes) and of the layer, then T = 16384 at
# both shapes: the workspace converting from the planar copy (chunks of 32 and 16 experts) beside the one
# converting from the MXFP4 tensors, the offline FP8 copy and the peer; the conversion alone (both sources, the
# planar program sweep); and the planar path without a workspace, whole and in slices of PLANAR_MAX_TOKENS.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s11c1; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}";
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $R/env.txt 2>&1
cat $R/env.txt
if [ "${TESTS_S:-120}" != 0 ]; then
  timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_moe.py::test_planar_conversion_real_shapes_gpu \
    tests/kernels/test_moe.py::test_workspace_from_the_planar_copy_matches_the_checkpoint_tensors \
    tests/kernels/test_moe.py::test_bench_convert_only_fills_the_workspace_as_run_layer_does \
    tests/kernels/test_moe.py::test_bench_sliced_planar_matches_one_call \
    tests/kernels/test_workspace_convert.py tests/runtime/test_expert_formats.py::test_mxfp4_kernel_layer_holds_one_planar_copy \
    "tests/runtime/test_kernel_paths.py::test_mxfp4_moe_kernel_tracks_the_reference" > $R/pytest_gpu.log 2>&1
  echo "rc=$?" >> $R/pytest_gpu.log; tail -6 $R/pytest_gpu.log
fi
for shape in ${SHAPES:-deepseek-v3 gpt-oss-120b}; do
  timeout "${BENCH_S:-150}" env PYTHONPATH=.:.peer python3 -m adapt.stages.bench_moe "/tmp/s11/$shape" --peer-only --large \
    --shapes "$shape" --tokens ${TOKENS:-16384} --budget-s $((${BENCH_S:-150} - 10)) \
    --variants ${VARIANTS:-fp8_ws_combine fp8_wsp_combine fp8_wsp16_combine fp8_offline_combine ws_convert_only "wsp_convert*" planar_sliced planar_combine} \
    > $R/bench_$shape.log 2>&1
  echo "$shape rc=$?"; cp /tmp/s11/$shape/moe_bench.json $R/moe_$shape.json 2>/dev/null
  grep -E "T=|FAILED|Error|peer try" $R/bench_$shape.log | tail -30
done
if [ -n "${MLA:-}" ]; then  # issue 16: the sparse MLA variants of mla_ws.py (LAZY rescale)
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -k "lazy" tests/kernels/test_sparse_mla_gluon.py \
    > $R/pytest_gpu_mla.log 2>&1; echo "rc=$?" >> $R/pytest_gpu_mla.log; tail -3 $R/pytest_gpu_mla.log
  timeout 120 python3 benchmarks/next/mla_ws.py $R/mla 100 > $R/mla_ws.log 2>&1; echo "mla rc=$?"; tail -20 $R/mla_ws.log
fi
date -u
