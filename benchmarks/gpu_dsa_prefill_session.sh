#!/usr/bin/env bash
# One H200 call for the DSA prefill kernels (issue 16, third session): the 128K prefill acceptance case with
# its sweeps (indexer tiles, sparse MLA tiles, top-k select methods), dense SDPA and same-run ceilings first,
# then the gpu-marked prefill tests in the time left.
# Usage (repo root, GPU machine): OUT=<dir> [BENCH_S=150] [TEST_S=70] [BENCH_ARGS=] bash benchmarks/gpu_dsa_prefill_session.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== DSA prefill acceptance"
timeout "${BENCH_S:-150}" python3 -m adapt.stages.bench_dsa --out "$OUT/dsa" --acceptance --prefill-only \
  ${BENCH_ARGS:-} > "$OUT/dsa_bench.log" 2>&1
tail -30 "$OUT/dsa_bench.log"
echo "== pytest -m gpu (DSA prefill)"
timeout "${TEST_S:-70}" python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 -x \
  tests/kernels/test_dsa_prefill.py tests/kernels/test_sparse_mla_prefill.py tests/kernels/test_dsa.py \
  tests/kernels/test_sparse_mla.py -k "${TEST_K:-prefill or test_dsa.py or tiles0- or tiles6 or tiles7}" \
  > "$OUT/pytest_gpu_dsa_prefill.log" 2>&1
tail -8 "$OUT/pytest_gpu_dsa_prefill.log"
