#!/usr/bin/env bash
# Session 20, call 3 (issue 16): the single-partition sparse MLA's L2 prefetch of the rows some tiles ahead
# (L2_AHEAD 2, 3, 4; last measured slower in session 4, before DIRECT and the other changes since) and the early
# gathers, in bf16 and F16, at batch 64 x 128K, in turns with the default; then bf16 / F16 on 4096 prefill rows
# (the fp8 kernel, upconvert off). About 150 s of command. CALL=s20c3 ADAPT_COMMIT=<sha> OUT=$OUT bash ...
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s20c3}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 200 > $R/smi.csv 2>&1 &
SMI=$!
V='[["bf16", {"cases": "b64"}], ["l2 ahead 2", {"L2_AHEAD": 2}], ["l2 ahead 3", {"L2_AHEAD": 3}],
 ["l2 ahead 4", {"L2_AHEAD": 4}], ["f16", {"F16": true}], ["f16 l2 ahead 2", {"F16": true, "L2_AHEAD": 2}],
 ["f16 l2 ahead 3", {"F16": true, "L2_AHEAD": 3}], ["early loads", {"EARLY_LOADS": true}],
 ["f16 early loads", {"F16": true, "EARLY_LOADS": true}], ["bf16 again", {}], ["l2 ahead 3 again", {"L2_AHEAD": 3}],
 ["f16 again", {"F16": true}]]'
timeout ${V_S:-150} python3 benchmarks/next/mla_f16.py $R/l2 130 "$V" > $R/l2.log 2>&1
echo "l2 rc=$? $(date -u +%T)" >> $R/runs.txt
cut -c1-330 $R/l2.log
V='[["bf16", {}], ["f16", {"F16": true}], ["bf16 again", {}], ["f16 again", {"F16": true}]]'
timeout ${P_S:-120} python3 benchmarks/next/mla_f16.py $R/probe 100 "$V" > $R/probe.log 2>&1
echo "probe rc=$? $(date -u +%T)" >> $R/runs.txt
grep prefill $R/probe.log | cut -c1-330
kill $SMI
cat $R/runs.txt
date -u
