#!/usr/bin/env bash
# H200 call for issue 15, session 4 round 2: the warp-specialized Gluon fold (moe_gluon.fold_gemm_ws_kernel)
# beside the round-1 Gluon fold and the offline FP8 path at T = 16384 (benchmarks/moe/gluon_check.py, each
# row compared with offline bit for bit), then the gpu-marked small-shape tests of the ws rows.
# Usage (carried copy of the branch, GPU machine): OUT=<dir> bash benchmarks/moe_s4_gluon_ws.sh
# Files under $OUT: session.log, check_<shape>.json, pytest_gpu.log.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout "${DS_S:-45}" python3 benchmarks/moe/gluon_check.py "$OUT/check_deepseek-v3.json" deepseek-v3 \
  fp8_gluon_split_combine fp8_gluon_ws_split_combine fp8_gluon_ws_split_n128_combine fp8_gluon_ws_n128_combine
echo "deepseek-v3 rc=$?"; date -u
timeout "${OSS_S:-30}" python3 benchmarks/moe/gluon_check.py "$OUT/check_gpt-oss-120b.json" gpt-oss-120b \
  fp8_gluon_split_combine fp8_gluon_ws_split_combine fp8_gluon_ws_split_n128_combine
echo "gpt-oss-120b rc=$?"; date -u
if [[ "${TEST_S:-30}" != 0 ]]; then
  timeout "${TEST_S:-30}" python3 -m pytest -m gpu -x -q -p no:cacheprovider tests/kernels/test_gluon_fold.py \
    -k "small and ws" > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest rc=$?"; tail -5 "$OUT/pytest_gpu.log"
fi
date -u
