#!/usr/bin/env bash
# The lead's closing H200 call of 2026-11-30's third session (issues 15 and 16): everything merged on main,
# timed in one call. Parts, each under its own timeout:
#   1. gpu-marked DSA tests (top-k incl. the decode select, indexer, sparse MLA decode and prefill options, transformers);
#   2. `bench_dsa --acceptance` (decode and prefill, with the sweeps, dense baselines and same-run ceilings);
#   3. gpu-marked MoE tests (planar, one-kernel MLP, in-GEMM fold);
#   4. `bench_moe --peer-only --large` for both shapes at every T beside triton_kernels (PEER holds it).
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> PEER=.peer bash benchmarks/gpu_s3_final.sh
# Env: DSA_TEST_S (80), DSA_S (170), MOE_TEST_S (60), MOE_S (100 per shape); 0 skips that part.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p "$OUT/dsa" "$OUT/moe"
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
skip() { [ "$1" = 0 ] && echo "(skipped)"; }
echo "== 1. DSA gpu tests"
skip "${DSA_TEST_S:-80}" || { timeout "${DSA_TEST_S:-80}" env PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 \
  tests/kernels/test_topk.py tests/kernels/test_topk_decode.py tests/kernels/test_dsa.py tests/kernels/test_dsa_prefill.py \
  tests/kernels/test_sparse_mla.py tests/kernels/test_sparse_mla_prefill.py tests/runtime/test_dsa_vs_transformers.py \
  -k "not deepseek_v32_shapes_on_gpu" > "$OUT/dsa/pytest_gpu_dsa.log" 2>&1
echo "dsa tests rc=$? at $(($(date +%s) - T0)) s"; tail -12 "$OUT/dsa/pytest_gpu_dsa.log"; }
echo "== 2. DSA acceptance"
skip "${DSA_S:-170}" || { timeout "${DSA_S:-170}" env PYTHONPATH=. python3 -m adapt.stages.bench_dsa --out "$OUT/dsa" --acceptance \
  > "$OUT/dsa/dsa_bench.log" 2>&1
echo "dsa bench rc=$? at $(($(date +%s) - T0)) s"; tail -30 "$OUT/dsa/dsa_bench.log"; }
echo "== 3. MoE gpu tests"
skip "${MOE_TEST_S:-60}" || { timeout "${MOE_TEST_S:-60}" env PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider \
  -k "planar or fold or one_kernel" tests/kernels/test_moe.py tests/kernels/test_fold_gemm.py \
  > "$OUT/moe/pytest_gpu_moe.log" 2>&1
echo "moe tests rc=$? at $(($(date +%s) - T0)) s"; tail -6 "$OUT/moe/pytest_gpu_moe.log"; }
echo "== 4. MoE beside the peer"
skip "${MOE_S:-100}" || for shape in deepseek-v3 gpt-oss-120b; do
  timeout "${MOE_S:-100}" env PYTHONPATH=.:${PEER:-.peer} python3 -m adapt.stages.bench_moe "/tmp/moe_final/$shape" \
    --peer-only --large --shapes "$shape" --tokens 64 1 16 256 1024 4096 16384 --budget-s $((${MOE_S:-100} - 8)) \
    > "$OUT/moe/bench_$shape.log" 2>&1
  echo "$shape rc=$? at $(($(date +%s) - T0)) s"; cp "/tmp/moe_final/$shape/moe_bench.json" "$OUT/moe/moe_$shape.json" 2>/dev/null
  grep -E "T=|FAILED|Error" "$OUT/moe/bench_$shape.log" | tail -60
done
date -u
