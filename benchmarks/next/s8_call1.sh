#!/usr/bin/env bash
# Session 8, first H200 call (issue 16): the Gluon candidate pass of the decode top-k. Its gpu tests (and the tl
# pass's), the probe (benchmarks/next/decode_gluon.py: batch 64 and the prefill against the tl pass), then the
# acceptance run with the Gluon pass on (`bench_dsa --decode-gluon`).
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> bash benchmarks/next/s8_call1.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:?}
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/session.log"; }
log "commit ${ADAPT_COMMIT:-unset}; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
log "1. gpu tests: topk_gluon, topk_decode"
timeout "${TEST_S:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_topk_gluon.py \
  tests/kernels/test_topk_decode.py > "$OUT/pytest_gpu.log" 2>&1; log "rc=$?"; tail -3 "$OUT/pytest_gpu.log"
log "2. probe: decode_gluon"
timeout "${PROBE_S:-200}" python3 benchmarks/next/decode_gluon.py "$OUT/probe" "${PROBE_BUDGET:-150}" \
  > "$OUT/probe.log" 2>&1; log "rc=$?"
if [ "${ACC_S:-240}" != 0 ]; then
  log "3. acceptance with the Gluon candidate pass"
  timeout "${ACC_S:-240}" python3 -m adapt.stages.bench_dsa --out "$OUT/acc" --acceptance --no-sweep --decode-gluon \
    --prefill-selects auto > "$OUT/acc.log" 2>&1; log "rc=$?"
fi
tar -C "$OUT" -czf "$OUT/results.tgz" probe acc pytest_gpu.log probe.log acc.log session.log 2>/dev/null
log "done"
