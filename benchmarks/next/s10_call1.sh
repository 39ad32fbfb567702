#!/usr/bin/env bash
# Session 10, call 1 (issue 15): the MoE gpu tests at main, then adapt's MXFP4-storage paths beside the peer
# (triton_kernels from vLLM 0.26.0's wheel, which vendors triton's python/triton_kernels at tag v3.6.0; carried in
# the git-ignored .peer) at every T of both shapes, with the offline FP8 path and the Gluon fold from T = 4096.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s10c1; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}";
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $R/env.txt 2>&1
cat $R/env.txt
if [ "${TESTS_S:-150}" != 0 ]; then
  timeout "${TESTS_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -k "planar or fold or one_kernel" \
    tests/kernels/test_moe.py tests/kernels/test_fold_gemm.py tests/kernels/test_gluon_fold.py > $R/pytest_gpu_moe.log 2>&1
  echo "rc=$?" >> $R/pytest_gpu_moe.log; tail -4 $R/pytest_gpu_moe.log
fi
for shape in ${SHAPES:-deepseek-v3 gpt-oss-120b}; do
  timeout "${BENCH_S:-150}" env PYTHONPATH=.:.peer python3 -m adapt.stages.bench_moe "/tmp/s10/$shape" --peer-only --large \
    --shapes "$shape" --tokens ${TOKENS:-64 1 16 256 1024 4096 16384} --budget-s $((${BENCH_S:-150} - 10)) \
    --variants ${VARIANTS:-planar_combine planar_fused planar_gemm1 planar_gemm2 fp8_ws_combine fp8_offline_combine fp8_gluon_split_combine ws_convert_only} \
    > $R/bench_$shape.log 2>&1
  echo "$shape rc=$?"; cp /tmp/s10/$shape/moe_bench.json $R/moe_$shape.json 2>/dev/null
  grep -E "T=|FAILED|Error|peer try" $R/bench_$shape.log | tail -40
done
date -u
tar czf $OUT/s10c1.tgz -C $OUT s10c1
