#!/usr/bin/env bash
# One H200 call for the fused decode top-k (issue 16, fourth session, branch s4-16t): the gpu-marked tests of the
# fused and device-side decode top-k and the decode indexer, the decode acceptance rows (fused default beside the
# path before it), then the per-kernel profile of one decode step at batch 1 and 64.
# Usage (repo root, GPU machine): OUT=<dir> [TEST_S=55] [BENCH_S=90] [PROF_S=15] bash benchmarks/gpu_dsa_s4_decode.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 ADAPT_COMMIT="${ADAPT_COMMIT:-}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== pytest -m gpu (fused decode top-k)"
timeout "${TEST_S:-55}" python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/kernels/test_topk_fused.py tests/kernels/test_topk_decode.py tests/kernels/test_dsa.py \
  -k "fused or decode" > "$OUT/pytest_gpu_fused.log" 2>&1
tail -8 "$OUT/pytest_gpu_fused.log"
echo "== DSA acceptance, decode"
timeout "${BENCH_S:-90}" python3 -m adapt.stages.bench_dsa --out "$OUT" --acceptance --no-prefill --no-sweep \
  > "$OUT/dsa_bench.log" 2>&1
rm -f "$OUT"/dsa_report.*  # the stage report repeats dsa_bench.json; the device returns 8 files at most
tail -30 "$OUT/dsa_bench.log"
echo "== kernel profile"
timeout "${PROF_S:-15}" python3 benchmarks/dsa_kernel_profile.py "$OUT" 1 64 > "$OUT/profile.log" 2>&1
tail -30 "$OUT/profile.log"
