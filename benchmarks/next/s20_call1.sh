#!/usr/bin/env bash
# Session 20, call 1 (issue 16): the Gluon sparse MLA decode kernel with fp16 MMAs (its F16 flag). The GPU tests of
# the kernel with F16 (against the bf16 and the fp16 twins and float64), then benchmarks/next/mla_f16.py (bf16,
# F16, F16, bf16 at batch 64 x 128K, batch 1, 4096 prefill rows), then the decode acceptance with --mla-f16 and
# without, in turns; SM clock and power logged. About 300 s of command.
# CALL=s20c1 ADAPT_COMMIT=<sha> OUT=$OUT bash benchmarks/next/s20_call1.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s20c1}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 200 > $R/smi.csv 2>&1 &
SMI=$!
echo "tests start $(date -u +%T)" >> $R/runs.txt
timeout ${TEST_S:-110} python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sparse_mla_gluon.py \
  -k "f16 or (batch64_matches_twin and options0) or (v32_shape_matches_twin and options0)" > $R/tests.log 2>&1
echo "tests rc=$? $(date -u +%T)" >> $R/runs.txt
tail -3 $R/tests.log
timeout ${PROBE_S:-100} python3 benchmarks/next/mla_f16.py $R/probe 80 > $R/probe.log 2>&1
echo "probe rc=$? $(date -u +%T)" >> $R/runs.txt
cat $R/probe.log | cut -c1-400
for run in f16_a:--mla-f16 bf16_a:--no-mla-f16 f16_b:--mla-f16; do
  IFS=: read name flag <<< "$run"
  timeout ${ACC_S:-90} python3 -m adapt.stages.bench_dsa --out $R/acc_$name --acceptance --no-sweep --no-prefill \
    --decode-batches 64 $flag > $R/dsa_$name.log 2>&1
  echo "acc $name rc=$? $(date -u +%T)" >> $R/runs.txt
  echo "$name:"; grep -E "sparse MLA decode|^ *(NOT )?MET" $R/dsa_$name.log | head -8
done
kill $SMI
cat $R/runs.txt
date -u
