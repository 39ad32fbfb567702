#!/usr/bin/env bash
# Session 20, call 8 (issue 16): the sparse MLA with the gathers two tiles ahead by cp.async into a staging buffer
# (CP: sparse_mla_gluon_cp_kernel, one dequantised slot). GPU tests of CP (bit-equal to the default kernel), then
# batch 64 x 128K, batch 1 and 4096 prefill rows over CP / CP + F16 / default in turns, then the decode acceptance
# with --mla-cp and without. About 300 s of command. CALL=s20c8 ADAPT_COMMIT=<sha> OUT=$OUT bash ...
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s20c8}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout ${TEST_S:-100} python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sparse_mla_gluon.py \
  -k "cp" > $R/tests.log 2>&1
echo "tests rc=$? $(date -u +%T)" >> $R/runs.txt
tail -15 $R/tests.log | cut -c1-300
V='[["bf16", {}], ["cp", {"CP": true}], ["cp f16", {"CP": true, "F16": true}], ["bf16 again", {}],
 ["cp again", {"CP": true}], ["cp f16 again", {"CP": true, "F16": true}]]'
timeout ${V_S:-150} python3 benchmarks/next/mla_f16.py $R/cp 130 "$V" > $R/cp.log 2>&1
echo "cp rc=$? $(date -u +%T)" >> $R/runs.txt
cut -c1-60,120-330 $R/cp.log
for run in cp_a:--mla-cp bf16_a:--no-mla-cp; do
  IFS=: read name flag <<< "$run"
  timeout ${ACC_S:-90} python3 -m adapt.stages.bench_dsa --out $R/acc_$name --acceptance --no-sweep --no-prefill \
    --decode-batches 1,64 $flag > $R/dsa_$name.log 2>&1
  echo "acc $name rc=$? $(date -u +%T)" >> $R/runs.txt
  echo "$name:"; grep -E "^ *(NOT )?MET: (sparse MLA|decode)" $R/dsa_$name.log
done
cat $R/runs.txt
date -u
