#!/usr/bin/env bash
# Session 20, call 6 (issue 16): the sparse MLA's gathers two tiles ahead (AHEAD2, built at ff175f8 and removed after
# this call: 8.5x slower; the sm_90 build spills about 2 KB
# a thread: 370-400 local stores and loads a tile), bf16 and F16, at batch 64 x 128K in turns with the default,
# each checked against the twins. About 60 s of command. CALL=s20c6 ADAPT_COMMIT=<sha> OUT=$OUT bash ...
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s20c6}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
V='[["bf16", {"cases": "b64"}], ["ahead2", {"AHEAD2": true}], ["f16 ahead2", {"F16": true, "AHEAD2": true}],
 ["f16", {"F16": true}], ["bf16 again", {}], ["ahead2 again", {"AHEAD2": true}],
 ["f16 ahead2 again", {"F16": true, "AHEAD2": true}], ["bf16 third", {}]]'
timeout ${V_S:-150} python3 benchmarks/next/mla_f16.py $R/ahead 130 "$V" > $R/ahead.log 2>&1
echo "ahead rc=$? $(date -u +%T)" >> $R/runs.txt
cut -c1-60,120-330 $R/ahead.log
cat $R/runs.txt
date -u
