#!/usr/bin/env bash
# H200 call for issue 15, session 4: the Gluon fold GEMM (adapt/kernels/moe_gluon.py) beside the offline FP8
# path, the workspace (online) path, the tl fold and triton_kernels v3.6.0 (git-ignored .peer, carried).
# Usage (carried copy of the branch, GPU machine):
#   ADAPT_COMMIT=<sha> OUT=<dir> PEER=<dir holding triton_kernels> bash benchmarks/moe_s4_gluon.sh
# Env: TEST_S (pytest seconds, 0: none), BENCH_S (per shape), SHAPES, TOKENS. Files under $OUT: session.log,
# pytest_gpu.log, bench_<shape>.log, moe_<shape>.json (at most 6).
set -u
export PYTHONPATH=.:${PEER:-.peer} PYTHONUNBUFFERED=1
W=/tmp/moe_s4; mkdir -p "$OUT" $W
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
if [[ "${TEST_S:-40}" != 0 ]]; then
  echo "== pytest gluon fold (gpu-marked: bit-equality to the offline path)"
  timeout "${TEST_S:-40}" python3 -m pytest -m gpu -x -q -p no:cacheprovider tests/kernels/test_gluon_fold.py \
    > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest rc=$?"; tail -15 "$OUT/pytest_gpu.log"
fi
for shape in ${SHAPES:-deepseek-v3 gpt-oss-120b}; do
  echo "== $shape"; date -u
  timeout "${BENCH_S:-60}" python3 -m adapt.stages.bench_moe "$W/$shape" --peer-only --shapes "$shape" \
    --tokens ${TOKENS:-16384} --large --budget-s $((${BENCH_S:-60} - 8)) > "$OUT/bench_$shape.log" 2>&1
  echo "$shape rc=$?"; cp "$W/$shape/moe_bench.json" "$OUT/moe_$shape.json" 2>/dev/null
  grep -E "T=|FAILED|Error" "$OUT/bench_$shape.log" | tail -30
done
date -u
