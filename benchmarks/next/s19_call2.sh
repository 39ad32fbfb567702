#!/usr/bin/env bash
# Session 19, call 2: issue 15's planar MoE layer kernel by kernel at T = 1, 16, 64 (moe_kernels.py), then issue 16's
# full acceptance at main's defaults; SM clock and power logged. About 200 s of command.
# CALL=s19c2 ADAPT_COMMIT=<sha> OUT=$OUT bash benchmarks/next/s19_call2.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s19c2}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 500 > $R/smi.csv 2>&1 &
SMI=$!
timeout ${MOE_S:-120} python3 benchmarks/next/moe_kernels.py $R/moe_kernels.json ${TOKENS:-1 16 64} > $R/moe_kernels.log 2>&1
echo "moe_kernels rc=$?"; cat $R/moe_kernels.log | cut -c1-150 | tail -60
if [ "${ACC_S:-170}" != 0 ]; then
  timeout ${ACC_S:-170} python3 -m adapt.stages.bench_dsa --out /tmp/acc --acceptance --no-sweep > $R/dsa.log 2>&1
  echo "acceptance rc=$?"; grep -E "^ *(NOT )?MET" $R/dsa.log | tail -8
fi
kill $SMI
date -u
