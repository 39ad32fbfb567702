#!/usr/bin/env bash
# The session-4 H200 call for issue 15 at small T (benchmarks/moe/2026-12-01-s4-small): both shapes at T = 1, 64, 16,
# 256 beside triton_kernels v3.6.0 (PEER, carried), the table's planar rows and the s4_* sweep tiles, then the
# gpu-marked twin tests of those tiles. Run from the carried copy of the branch on the GPU machine:
#   OUT=<dir> PEER=<dir holding triton_kernels> BENCH_S=<s per shape> TEST_S=<s> bash benchmarks/moe/2026-12-01-s4-small/session.sh
# Files under $OUT (six): session.log, bench_<shape>.log, moe_<shape>.json, pytest_gpu.log.
set -u
export PYTHONPATH=.:${PEER:-.peer} PYTHONUNBUFFERED=1
W=/tmp/moe_s4; mkdir -p "$OUT" $W
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
for shape in ${SHAPES:-deepseek-v3 gpt-oss-120b}; do
  echo "== $shape"; date -u
  timeout "${BENCH_S:-50}" python3 -m adapt.stages.bench_moe "$W/$shape" --peer-only --shapes "$shape" \
    --tokens ${TOKENS:-1 64 16 256} --planar-sweep --variants planar_combine planar_fused 'planar_gemm*' 's4_*' \
    --budget-s $((${BENCH_S:-50} - 6)) > "$OUT/bench_$shape.log" 2>&1
  echo "$shape rc=$?"; cp "$W/$shape/moe_bench.json" "$OUT/moe_$shape.json" 2>/dev/null
  grep -E "T=|FAILED|Error" "$OUT/bench_$shape.log" | grep -v "^sweep" | tail -30
  grep "^sweep" "$OUT/bench_$shape.log" | tail -20
done
echo "== pytest -m gpu tests/kernels/test_moe_planar_s4.py"; date -u
timeout "${TEST_S:-40}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_moe_planar_s4.py \
  > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; tail -4 "$OUT/pytest_gpu.log"
date -u
