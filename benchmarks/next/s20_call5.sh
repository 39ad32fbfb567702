#!/usr/bin/env bash
# Session 20, call 5 (issue 16): the sparse MLA's dequantised stores without bank conflicts (GATHER_ROWS 8: a warp
# gathers 4 chunks of 8 rows, not one whole row). GPU tests of GATHER_ROWS (bit-equal to 1), then batch 64 x 128K
# over GATHER_ROWS 1 / 4 / 8 in bf16 and F16 in turns, Nsight Compute's shared-store conflicts at 8, then the decode
# acceptance with --mla-gather-rows 8. About 300 s of command. CALL=s20c5 ADAPT_COMMIT=<sha> OUT=$OUT bash ...
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s20c5}; mkdir -p $R
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout ${TEST_S:-120} python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sparse_mla_gluon.py \
  -k "rows" > $R/tests.log 2>&1
echo "tests rc=$? $(date -u +%T)" >> $R/runs.txt
tail -3 $R/tests.log
V='[["bf16", {"cases": "b64"}], ["rows8", {"GATHER_ROWS": 8}], ["rows4", {"GATHER_ROWS": 4}],
 ["f16 rows8", {"F16": true, "GATHER_ROWS": 8}], ["f16", {"F16": true}], ["rows8 again", {"GATHER_ROWS": 8}],
 ["bf16 again", {}], ["f16 rows8 again", {"F16": true, "GATHER_ROWS": 8}], ["rows8 third", {"GATHER_ROWS": 8}],
 ["bf16 third", {}]]'
timeout ${V_S:-150} python3 benchmarks/next/mla_f16.py $R/rows 130 "$V" > $R/rows.log 2>&1
echo "rows rc=$? $(date -u +%T)" >> $R/runs.txt
cut -c1-60,200-330 $R/rows.log
for run in rows8:'{"GATHER_ROWS": 8}'; do
  IFS=: read name flags <<< "$run"
  timeout 120 $NCU --clock-control none --set full --import-source no -k 'regex:sparse_mla_gluon_kernel' \
    --launch-skip 2 --launch-count 1 --export /tmp/mla_$name -f python3 benchmarks/next/mla_ncu.py 4 "$flags" > $R/ncu_$name.log 2>&1
  echo "ncu $name rc=$?"
  $NCU --import /tmp/mla_$name.ncu-rep --page details > $R/ncu_details_$name.txt 2>&1
  grep -E "Duration|bank|Issue Slots|Eligible Warps" $R/ncu_details_$name.txt | head -12
done
for run in r8_a:'--mla-gather-rows 8' r1_a:'--mla-gather-rows 1' r8_b:'--mla-gather-rows 8'; do
  IFS=: read name flag <<< "$run"
  timeout ${ACC_S:-90} python3 -m adapt.stages.bench_dsa --out $R/acc_$name --acceptance --no-sweep --no-prefill \
    --decode-batches 64 $flag > $R/dsa_$name.log 2>&1
  echo "acc $name rc=$? $(date -u +%T)" >> $R/runs.txt
  echo "$name: $(grep -E 'MET: (sparse MLA|decode batch 64)' $R/dsa_$name.log | tr '\n' ' ')"
done
cat $R/runs.txt
date -u
