#!/usr/bin/env bash
# Next session's first call (issue 16): the prefill acceptance with the warp-specialised indexer kernel at 4 and at 3
# key pages in flight (dsa.PREFILL_WS_STAGES, 3 now), in turns, then index_wg.py; SM clock and power logged.
# About 150 s of command. CALL=s19c1 ADAPT_COMMIT=<sha> OUT=$OUT bash benchmarks/next/s19_call1.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s19c1}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 500 > $R/smi.csv 2>&1 &
SMI=$!
for run in s4a s3a s4b s3b; do
  timeout ${ACC_S:-60} python3 -m adapt.stages.bench_dsa --out $R/acc_$run --acceptance --no-sweep --prefill-only \
    --prefill-ws-stages ${run:1:1} > $R/dsa_$run.log 2>&1
  echo "acceptance $run rc=$?"; grep -E "indexer prefill|speedup over" $R/dsa_$run.log | grep -E "^ *(NOT )?MET" | tail -2
done
if [ "${PROBE_S:-100}" != 0 ]; then
  timeout ${PROBE_S:-100} python3 benchmarks/next/index_wg.py $R ${ROUNDS:-2} ${BUDGET:-80} > $R/index_wg.log 2>&1
  echo "probe rc=$?"; grep -v '^{"variant"' $R/index_wg.log | tail -10
fi
kill $SMI
date -u
