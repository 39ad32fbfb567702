#!/usr/bin/env bash
# One H200 call that records everything the issues ask of the GPU: the `gpu`-marked tests of
# every module, the MoE and DSA acceptance benchmarks, and the runtime's kernel-path greedy run.
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_session.sh
# Tiny models: build them on a machine with transformers >= 5.16 into .tiny-cache and carry it.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 ADAPT_CACHE_DIR="$PWD/.tiny-cache"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== pytest -m gpu"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 tests > "$OUT/pytest_gpu.log" 2>&1
tail -20 "$OUT/pytest_gpu.log"
echo "== runtime greedy, kernels on"
timeout 50 python3 benchmarks/runtime_kernel_greedy.py --device cuda --json "$OUT/greedy_gpu.json" 2>&1 | tail -8
echo "== MoE acceptance"
timeout 150 python3 -m adapt.stages.bench_moe "$OUT/moe" --quick-acceptance --budget-s 125 > "$OUT/moe_bench.log" 2>&1
tail -25 "$OUT/moe_bench.log"
echo "== DSA acceptance"
timeout 130 python3 -m adapt.stages.bench_dsa --out "$OUT/dsa" --acceptance > "$OUT/dsa_bench.log" 2>&1
tail -25 "$OUT/dsa_bench.log"
