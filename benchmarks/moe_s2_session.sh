#!/usr/bin/env bash
# H200 call(s) for issue 15, session 2: the nibble-layout planar kernel beside triton_kernels v3.6.0
# (git-ignored .peer, carried), both in one process per shape with the same-run ceilings.
# Usage (from the carried copy of the branch, GPU machine):
#   ADAPT_COMMIT=<sha> OUT=<dir> PEER=<dir holding triton_kernels> bash benchmarks/moe_s2_session.sh
# Env: PARTS ("test bench"), TEST_S / TEST_K / TEST_M (pytest subset: -k TEST_K, -m TEST_M, default gpu), SHAPES, TOKENS, BENCH_S (per
# shape), SWEEP=1 (--planar-sweep: the PLANAR_SWEEP configs at each T), LARGE=1 (--large: the fp8
# online / offline paths above 4096). Files under $OUT: session.log, pytest_gpu.log, bench_<shape>.log,
# moe_<shape>.json (at most 8 with two shapes).
set -u
export PYTHONPATH=.:${PEER:-.peer} PYTHONUNBUFFERED=1
W=/tmp/moe_s2; mkdir -p "$OUT" $W
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
PARTS=" ${PARTS:-test bench} "
if [[ "$PARTS" == *" test "* ]]; then
  echo "== pytest -m '${TEST_M:-gpu}' -k '${TEST_K:-planar}'"
  timeout "${TEST_S:-60}" python3 -m pytest -m "${TEST_M:-gpu}" -q -p no:cacheprovider -k "${TEST_K:-planar}" \
    tests/kernels/test_moe.py tests/kernels/test_mxfp4.py > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest rc=$?"; tail -4 "$OUT/pytest_gpu.log"
fi
if [[ "$PARTS" == *" bench "* ]]; then
  for shape in ${SHAPES:-deepseek-v3 gpt-oss-120b}; do
    echo "== $shape"; date -u
    timeout "${BENCH_S:-90}" python3 -m adapt.stages.bench_moe "$W/$shape" --peer-only --shapes "$shape" \
      --tokens ${TOKENS:-1 16 64 256 1024 4096 16384} ${SWEEP:+--planar-sweep} ${LARGE:+--large} \
      --budget-s $((${BENCH_S:-90} - 8)) > "$OUT/bench_$shape.log" 2>&1
    echo "$shape rc=$?"; cp "$W/$shape/moe_bench.json" "$OUT/moe_$shape.json" 2>/dev/null
    grep -E "T=|peer try|FAILED|Error" "$OUT/bench_$shape.log" | grep -v "^sweep" | tail -30
    grep "^sweep" "$OUT/bench_$shape.log" | awk '{print $2, $3, $4}' | tail -40
  done
fi
date -u
