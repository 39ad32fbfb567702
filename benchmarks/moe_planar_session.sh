#!/usr/bin/env bash
# One H200 call for the planar MoE path (issue 15): the gpu-marked MoE tests, then each shape at
# every T with the planar configs swept, beside the old bf16 path, the offline FP8 path, the online
# FP8 workspace and torch's grouped bf16 GEMM, with the same-run copy ceiling (one process a shape).
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> BENCH_S=<s per shape> bash benchmarks/moe_planar_session.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== pytest -m gpu"
timeout "${TEST_S:-60}" python3 -m pytest -m gpu -q -p no:cacheprovider -k "${TEST_K:-planar}" tests/kernels/test_moe.py \
  > "$OUT/pytest_gpu.log" 2>&1
tail -4 "$OUT/pytest_gpu.log"
echo "== MoE bench"
for shape in ${SHAPES:-deepseek-v3 gpt-oss-120b}; do
  timeout "$BENCH_S" python3 -m adapt.stages.bench_moe "$OUT/$shape" --shapes "$shape" \
    --tokens ${TOKENS:-1 16 64 256 1024 4096 16384} --no-sweep --planar-sweep --no-layer --no-memory \
    --variants ${VARIANTS:-planar bf16 fp8_offline fp8_ws torch_grouped_bf16} --budget-s $((BENCH_S - 15)) \
    > "$OUT/bench_$shape.log" 2>&1
  grep -E "T=|FAILED|Error" "$OUT/bench_$shape.log" | grep -v "^sweep" | tail -40
done
