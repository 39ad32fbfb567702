#!/usr/bin/env bash
# Session 19, call 5 (issue 16): the indexer line now timed as CUDA-graph replays of the chunk loop (the eager figure
# beside it): the prefill acceptance in a compiling process, a warm one, and another compiling one; SM clock and power
# logged. About 100 s of command. CALL=s19c5 ADAPT_COMMIT=<sha> OUT=$OUT bash benchmarks/next/s19_call5.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s19c5}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 200 > $R/smi.csv 2>&1 &
SMI=$!
C1=$(mktemp -d); C2=$(mktemp -d)
for run in a_cold1:$C1 b_warm1:$C1 c_cold2:$C2; do
  IFS=: read name cache <<< "$run"
  echo "$name start $(date -u +%T.%N | cut -c1-12)" >> $R/runs.txt
  TRITON_CACHE_DIR=$cache timeout ${ACC_S:-80} python3 -m adapt.stages.bench_dsa --out /tmp/acc_$name --acceptance \
    --no-sweep --prefill-only > $R/dsa_$name.log 2>&1
  echo "$name rc=$? end $(date -u +%T.%N | cut -c1-12)" >> $R/runs.txt
  echo "$name: $(grep -E '^  131072:' $R/dsa_$name.log | cut -c1-60)"
  grep -E "scores over all rows|^ *(NOT )?MET" $R/dsa_$name.log
done
kill $SMI
cat $R/runs.txt
date -u
