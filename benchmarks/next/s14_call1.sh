#!/usr/bin/env bash
# Session 14, call 1 (issue 16, batch 1): b1_pages.py twice (the harness's scoring swing: ordered / shuffled block
# tables over several caches), b1_chain.py (this card's baseline), then Nsight Compute on the eager step's kernels
# (sections; the select and scoring kernels' SASS stall samples).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s14c1; mkdir -p $R
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; echo "ncu: $NCU"; } > $R/env.txt 2>&1
cat $R/env.txt
for i in 1 2; do
  timeout 120 python3 benchmarks/next/b1_pages.py /tmp/pages$i > $R/pages$i.log 2>&1; echo "pages $i rc=$?"
  grep -A30 '^{$' $R/pages$i.log | head -40
done
timeout 100 python3 benchmarks/next/b1_chain.py $R ${ROUNDS:-3} > $R/b1_chain.log 2>&1
echo "chain rc=$?"; grep -A20 '^{$' $R/b1_chain.log | head -30
if [ -n "$NCU" ]; then
  K='regex:index_scores|grid_select|zero_prefix|mla|combine'
  for t in ordered shuffled; do
    timeout 150 $NCU --clock-control none -k "$K" --launch-skip 30 --launch-count 6 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 benchmarks/next/b1_ncu.py 12 $t > $R/ncu_sections_$t.txt 2>&1
    echo "ncu sections $t rc=$?"
  done
  timeout 200 $NCU --clock-control none --set full --import-source no -k 'regex:index_scores|grid_select' \
    --launch-skip 10 --launch-count 2 --export /tmp/b1rep -f python3 benchmarks/next/b1_ncu.py 10 > $R/ncu_full.log 2>&1
  echo "ncu full rc=$?"
  $NCU --import /tmp/b1rep.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2> $R/ncu_src.err
  echo "src rc=$? $(wc -c < /tmp/src.csv)"
  python3 benchmarks/next/ncu_top.py /tmp/src.csv 45 > $R/ncu_top.txt 2>&1; head -60 $R/ncu_top.txt
  $NCU --import /tmp/b1rep.ncu-rep --page details > $R/ncu_details.txt 2>&1
fi
date -u
