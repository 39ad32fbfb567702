#!/usr/bin/env bash
# Session 7, first H200 call (issues 15 and 16), on main: the 128K prefill with the device-side decode select
# beside the default prefiltered select (same call, same inputs), a per-kernel profile of the batch-1 and
# batch-64 decode steps, and the DeepSeek-V3 MoE points T = 1 and 64 again (no peer carried).
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> bash benchmarks/next/s7_call1.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:?}
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/session.log"; }
log "commit ${ADAPT_COMMIT:-unset}; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
log "1. prefill 128K: selects auto, decode"
timeout "${PREFILL_S:-150}" python3 -m adapt.stages.bench_dsa --out "$OUT/prefill" --acceptance --prefill-only \
  --no-sweep --prefill-selects auto,decode > "$OUT/prefill.log" 2>&1; log "rc=$?"
log "2. decode step kernel profile, batch 1 and 64"
timeout "${PROFILE_S:-60}" python3 benchmarks/dsa_kernel_profile.py "$OUT/profile" 1 64 > "$OUT/profile.log" 2>&1
log "rc=$?"
log "3. MoE DeepSeek-V3 T = 1, 64"
timeout "${MOE_S:-90}" python3 -m adapt.stages.bench_moe "$OUT/moe" --tokens 1 64 --shapes deepseek-v3 --no-sweep \
  --no-layer --no-memory --budget-s 80 > "$OUT/moe.log" 2>&1; log "rc=$?"
tar -C "$OUT" -czf "$OUT/results.tgz" prefill profile moe prefill.log profile.log moe.log 2>/dev/null
log "done"
