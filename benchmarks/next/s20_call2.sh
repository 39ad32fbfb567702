#!/usr/bin/env bash
# Session 20, call 2 (issue 16): F16 in the warp-specialised sparse MLA (its producer's dequantisation a third of the
# instructions, so a smaller producer leaves the consumers more registers), at batch 64 x 128K beside the
# single-partition kernel in bf16 and F16; then mla_f16.py's full run (bf16 / F16 at batch 1 and 4096 prefill rows).
# About 300 s of command. CALL=s20c2 ADAPT_COMMIT=<sha> OUT=$OUT bash benchmarks/next/s20_call2.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s20c2}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 200 > $R/smi.csv 2>&1 &
SMI=$!
V='[["bf16", {"cases": "b64"}], ["f16", {"F16": true}],
 ["ws bf16 pair 152", {"WS": true}], ["ws f16 pair 152", {"WS": true, "F16": true}],
 ["ws f16 single 112", {"WS": true, "F16": true, "PAIR": false, "PREGS": 112}],
 ["ws f16 single 112 pv_wait", {"WS": true, "F16": true, "PAIR": false, "PREGS": 112, "PV_WAIT": true}],
 ["ws f16 single 96", {"WS": true, "F16": true, "PAIR": false, "PREGS": 96}],
 ["ws f16 pair 152 pv_wait", {"WS": true, "F16": true, "PV_WAIT": true}],
 ["f16 again", {"F16": true}], ["bf16 again", {}]]'
timeout ${WS_S:-220} python3 benchmarks/next/mla_f16.py $R/ws 200 "$V" > $R/ws.log 2>&1
echo "ws rc=$? $(date -u +%T)" >> $R/runs.txt
cut -c1-330 $R/ws.log
timeout ${PROBE_S:-150} python3 benchmarks/next/mla_f16.py $R/probe 130 > $R/probe.log 2>&1
echo "probe rc=$? $(date -u +%T)" >> $R/runs.txt
cut -c1-330 $R/probe.log
kill $SMI
cat $R/runs.txt
date -u
