#!/usr/bin/env bash
# One H200 call landing three pending measurements, each part under its own `timeout`:
#  1. issue 15: MoE experts, both shapes, T = 1..16384: adapt planar (default tables), online fp8
#     workspace, fp8 offline, torch grouped bf16 and the peer triton_kernels v3.6.0 matmul_ogs (MXFP4,
#     Hopper layout; imported from the git-ignored .peer/ when present), same-run ceilings.
#  2. issue 16: the DSA acceptance run (decode batch 1 and 64 x 128K, prefill 128K, current defaults).
#  3. issue 13 item 6: `adapt bench runtime`, DeepSeek-V3.2 width at batch 16, 64, gpt-oss-120b at 64.
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_final_session.sh
# PARTS (default "moe dsa runtime"; "peer" alone: the peer-only rerun of bench_moe --peer-only).
# Files under $OUT (8): session.log, moe_<shape>.json x2, moe.log, dsa_bench.json, dsa.log,
# runtime_ds.json, runtime_oss.json (stderr of every part but MoE and DSA goes to session.log).
set -u
export PYTHONPATH=.:.peer PYTHONUNBUFFERED=1
W=/tmp/gpu_final; mkdir -p "$OUT" $W
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
PARTS=" ${PARTS:-moe dsa runtime} "
if [[ "$PARTS" == *" peer "* ]]; then
  # a second call's part: only the peer beside adapt's planar kernel (setups tried until finite)
  echo "== 1b. peer beside planar (peer: $(cat .peer/SOURCE 2>/dev/null || echo absent))"
  timeout "${PEER_S:-95}" python3 -m adapt.stages.bench_moe "$W/peer" --peer-only --shapes gpt-oss-120b deepseek-v3 \
    --budget-s $((${PEER_S:-95} - 12)) > "$OUT/peer.log" 2>&1
  echo "peer rc=$?"; cp "$W/peer/moe_bench.json" "$OUT/moe_peer.json" 2>/dev/null; grep -v "^{" "$OUT/peer.log" | tail -40
fi
[[ "$PARTS" == *" moe "* ]] && echo "== 1. MoE (peer: $(cat .peer/SOURCE 2>/dev/null || echo absent))"
[[ "$PARTS" == *" moe "* ]] && for shape in deepseek-v3 gpt-oss-120b; do
  s=$([ "$shape" = deepseek-v3 ] && echo "${MOE_DS_S:-100}" || echo "${MOE_OSS_S:-80}")
  timeout "$s" python3 -m adapt.stages.bench_moe "$W/$shape" --shapes "$shape" \
    --tokens ${TOKENS:-1 16 64 256 1024 4096 16384} --no-sweep --no-layer --no-memory \
    --variants planar fp8_ws fp8_offline torch_grouped_bf16 peer --budget-s $((s - 12)) >> "$OUT/moe.log" 2>&1
  echo "$shape rc=$?"; cp "$W/$shape/moe_bench.json" "$OUT/moe_$shape.json" 2>/dev/null
  grep -E "T=|peer" "$OUT/moe.log" | grep "^$shape" | tail -45
done
[[ "$PARTS" != *" dsa "* ]] && exit 0
echo "== 2. DSA acceptance"; date -u
timeout "${DSA_S:-95}" python3 -m adapt.stages.bench_dsa --out "$W/dsa" --acceptance > "$OUT/dsa.log" 2>&1
echo "dsa rc=$?"; cp "$W/dsa/dsa_bench.json" "$OUT/dsa_bench.json" 2>/dev/null; tail -30 "$OUT/dsa.log"
echo "== 3. runtime"; date -u
timeout "${RT_DS_S:-70}" python3 -m adapt.cli bench runtime -m deepseek-v3.2 -b 16 -b 64 \
  --budget-s $((${RT_DS_S:-70} - 8)) -o "$W/rt_ds" --json > "$OUT/runtime_ds.json"
echo "runtime deepseek rc=$?"; date -u
timeout "${RT_OSS_S:-35}" python3 -m adapt.cli bench runtime -m gpt-oss-120b -b 64 \
  --budget-s $((${RT_OSS_S:-35} - 6)) -o "$W/rt_oss" --json > "$OUT/runtime_oss.json"
echo "runtime gpt-oss rc=$?"; ls -R "$W"/rt_* | head -20; date -u
