#!/usr/bin/env bash
# The lead's closing H200 call of 2026-12-01's fourth session (issues 15 and 16): main with every branch merged.
# Parts, each under its own timeout (seconds from the environment; 0 skips a part):
#   1. GLUON_MLA_TEST_S: gpu tests of the Gluon sparse MLA (the DIRECT default, L2_AHEAD options);
#   2. TOPK_TEST_S: gpu tests of the decode top-k's short select (fast_select, the 64 x 128K CUDA-graph tests);
#   3. MLA_TIME_S: benchmarks/sparse_mla_gluon_h200.py, default vs L2_AHEAD 2 / 4 (decode b64 x 128K, prefill rows);
#   4. SELECT_TIME_S: benchmarks/topk_decode_flat.py fast (the short select's tiles beside the default);
#   5. DSA_S: `bench_dsa --acceptance --no-sweep` (decode b1 / b64 x 128K and the 128K prefill at the defaults, dense
#      baselines, same-run ceilings);
#   6. MOE_S: MOE_CMD (the Gluon fold's round-2 check, benchmarks/moe/NEXT_RUN.md).
# Everything lands under $OUT/r and is packed into $OUT/results.tgz (a call returns 8 files only).
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_s4_final.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
R="$OUT/r"
mkdir -p "$R"
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
echo "commit ${ADAPT_COMMIT:-unknown}"
pack() { tar -C "$OUT" -czf "$OUT/results.tgz" r; }
trap pack EXIT
part() {  # part NAME SECONDS COMMAND...
  local name=$1 s=$2; shift 2
  echo "== $name (limit ${s} s, at $(($(date +%s) - T0)) s)"
  [ "$s" = 0 ] && { echo "(skipped)"; return; }
  timeout "$s" bash -c "$*" > "$R/$name.log" 2>&1
  echo "$name rc=$? at $(($(date +%s) - T0)) s"; tail -n "${TAIL:-8}" "$R/$name.log"
}
part pytest_gluon_mla "${GLUON_MLA_TEST_S:-80}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_sparse_mla_gluon.py
part pytest_topk "${TOPK_TEST_S:-70}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_topk_decode.py \
  -k "'fast_select or cuda_graph'"
part mla_l2 "${MLA_TIME_S:-60}" python3 benchmarks/sparse_mla_gluon_h200.py "$R/mla_l2.json" \
  "'{\"only\": [\"gluon\", \"gluon l2 ahead 2\", \"gluon l2 ahead 4\"], \"batches\": [64], \"step\": false}'"
part topk_select "${SELECT_TIME_S:-45}" python3 benchmarks/topk_decode_flat.py "$R" fast
TAIL=40 part dsa_acceptance "${DSA_S:-130}" python3 -m adapt.stages.bench_dsa --out "$R/dsa" --acceptance --no-sweep
TAIL=20 part moe "${MOE_S:-100}" "${MOE_CMD:-echo no MOE_CMD}"
date -u; echo "total $(($(date +%s) - T0)) s"
