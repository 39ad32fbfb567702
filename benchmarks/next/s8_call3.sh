#!/usr/bin/env bash
# Session 8, third H200 call (issue 16): batch-1 decode with topk_decode (the Gluon candidate pass over many parts,
# the flat select) against the radix select. The gpu tests of the top-k and dsa dispatch, the batch-1 grid of
# benchmarks/next/decode_select.py, then the decode acceptance with the fastest exact variant as the few-rows select
# (when it beats the radix select in the probe), then the whole acceptance at main's defaults.
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> bash benchmarks/next/s8_call3.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:?}
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/session.log"; }
log "commit ${ADAPT_COMMIT:-unset}; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
log "1. gpu tests: topk_gluon, topk_decode"
timeout "${TEST_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_topk_gluon.py \
  tests/kernels/test_topk_decode.py > "$OUT/pytest_gpu.log" 2>&1; log "rc=$?"; tail -2 "$OUT/pytest_gpu.log"
log "2. batch-1 select grid"
timeout 120 python3 benchmarks/next/decode_select.py "$OUT/b1" 80 b1 > "$OUT/b1.log" 2>&1; log "rc=$?"
BEST=$(python3 - "$OUT/b1/decode_select.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["batches"][0]["rows"]
radix = [r["us"] for r in rows if r.get("name", "").startswith("radix") and r.get("equals_twin")]
ok = [r for r in rows if "name" not in r and r.get("equals_twin") and r.get("redo_rows") == 0 and "us" in r
      and r.get("gluon", True)]
if radix and ok and min(r["us"] for r in ok) < radix[0]:
    best = min(ok, key=lambda r: r["us"])
    print(json.dumps({k: v for k, v in best.items() if k not in ("us", "equals_twin", "redo_rows", "timed_as")}))
PY
)
log "best batch-1 decode options: ${BEST:-none (the radix select stays)}"
if [ -n "$BEST" ]; then
  log "3. decode acceptance with the few-rows decode select"
  timeout 150 python3 -m adapt.stages.bench_dsa --out "$OUT/acc_b1" --acceptance --no-sweep --no-prefill \
    --few-rows-select decode --few-rows-options "$BEST" > "$OUT/acc_b1.log" 2>&1; log "rc=$?"
fi
log "4. acceptance at main's defaults"
timeout 240 python3 -m adapt.stages.bench_dsa --out "$OUT/acc" --acceptance --no-sweep --prefill-selects auto \
  > "$OUT/acc.log" 2>&1; log "rc=$?"
tar -C "$OUT" -czf "$OUT/results.tgz" b1 acc acc_b1 pytest_gpu.log b1.log acc.log acc_b1.log session.log 2>/dev/null
log "done"
