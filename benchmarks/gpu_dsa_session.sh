#!/usr/bin/env bash
# One H200 call for the DSA kernels (issue 16): the gpu-marked DSA tests (a subset of the 128-head
# sparse MLA tiles, to fit the call) and the DSA acceptance benchmark with same-run ceilings.
# Usage (repo root, GPU machine): OUT=<dir> [TEST_S=80] [BENCH_S=190] [BENCH_ARGS="--no-sweep --no-prefill"] [TESTS=0] [TEST_K=...]
#   bash benchmarks/gpu_dsa_session.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${TESTS:-1}" != 0 ]; then
  echo "== pytest -m gpu (DSA)"
  timeout "${TEST_S:-80}" python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 \
    tests/kernels/test_topk.py tests/kernels/test_dsa.py tests/kernels/test_sparse_mla.py \
    tests/runtime/test_dsa_vs_transformers.py \
    -k "${TEST_K:-not deepseek_v32_shapes_on_gpu or topk or test_dsa.py or tiles0- or tiles7 or tiles9 or tiles10 or tiles11 or tiles12 or tiles13}" \
    > "$OUT/pytest_gpu_dsa.log" 2>&1
  tail -15 "$OUT/pytest_gpu_dsa.log"
fi
echo "== DSA acceptance"
timeout "${BENCH_S:-190}" python3 -m adapt.stages.bench_dsa --out "$OUT/dsa" --acceptance ${BENCH_ARGS:-} > "$OUT/dsa_bench.log" 2>&1
tail -40 "$OUT/dsa_bench.log"
