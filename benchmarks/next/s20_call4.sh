#!/usr/bin/env bash
# Session 20, call 4 (issue 16): Nsight Compute on the Gluon sparse MLA decode kernel at batch 64 x 128K (the
# default, bf16), and the same with no gathers (ABLATE 1): SASS stall samples a line (ncu_top.py) and the details
# page (warp states, memory). About 200 s of command. CALL=s20c4 ADAPT_COMMIT=<sha> OUT=$OUT bash ...
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s20c4}; mkdir -p $R
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; echo "ncu $NCU"; } > $R/env.txt 2>&1
cat $R/env.txt
for run in default:'{}' nogather:'{"ABLATE_PROBE": 1}'; do
  IFS=: read name flags <<< "$run"
  [ "$name" = nogather ] && continue
  timeout 200 $NCU --clock-control none --set full --import-source no -k 'regex:sparse_mla_gluon_kernel' \
    --launch-skip 2 --launch-count 1 --export /tmp/mla_$name -f python3 benchmarks/next/mla_ncu.py 4 "$flags" > $R/ncu_$name.log 2>&1
  echo "ncu $name rc=$?"
  $NCU --import /tmp/mla_$name.ncu-rep --page source --csv --print-source sass > /tmp/src_$name.csv 2>> $R/ncu_$name.log
  python3 benchmarks/next/ncu_top.py /tmp/src_$name.csv 80 > $R/ncu_top_$name.txt 2>&1
  $NCU --import /tmp/mla_$name.ncu-rep --page details > $R/ncu_details_$name.txt 2>&1
  head -30 $R/ncu_top_$name.txt
  grep -iE "stall|Duration|Throughput|Issue Slots|Warp Cycles|Eligible|Active Warps" $R/ncu_details_$name.txt | head -60
done
date -u
