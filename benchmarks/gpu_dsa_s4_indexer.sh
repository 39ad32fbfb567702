#!/usr/bin/env bash
# One H200 call for the Gluon indexer prefill kernel (issue 16, fourth session): the gpu-marked Gluon tests
# first, then the 128K acceptance prefill with the tl default and the Gluon rows that pass their check
# (benchmarks/gpu_dsa_s4_indexer.py).
# Usage (repo root, GPU machine): OUT=<dir> [TEST_S=50] [BENCH_S=100] bash benchmarks/gpu_dsa_s4_indexer.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
echo "== pytest -m gpu (Gluon indexer)"
timeout "${TEST_S:-50}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_dsa_gluon.py \
  > "$OUT/pytest_gpu_dsa_gluon.log" 2>&1
rc=$?
tail -15 "$OUT/pytest_gpu_dsa_gluon.log"
echo "pytest rc $rc"
echo "== DSA prefill acceptance (tl default vs Gluon)"
timeout "${BENCH_S:-100}" python3 benchmarks/gpu_dsa_s4_indexer.py \
  "$OUT/dsa" > "$OUT/dsa_bench.log" 2>&1
echo "bench rc $?"
tail -40 "$OUT/dsa_bench.log"
