#!/usr/bin/env bash
# Session 17, call 1 (issue 16, indexer prefill): the multi-warpgroup Gluon kernel's gpu tests, index_wg.py (each
# variant checked against tl and the twin, then timed in turns on the last 4096 rows and over all 128K rows), then
# Nsight Compute sections of the tl tile and the two-warpgroup kernel on the last 4096 rows.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s17c1; mkdir -p $R
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; echo "ncu: $NCU"; } > $R/env.txt 2>&1
cat $R/env.txt
T=tests/kernels/test_dsa_gluon.py
timeout ${TEST_S:-150} python3 -m pytest -q -x -p no:cacheprovider \
  "$T::test_gluon_scores_at_deepseek_shapes_on_gpu[wg2]" "$T::test_gluon_scores_at_deepseek_shapes_on_gpu[wg2c]" \
  $(for i in 9 10 11 12 13 14 15 16; do echo "$T::test_gluon_scores_match_twin_on_gpu[opts$i]"; done) > $R/pytest.log 2>&1
echo "pytest rc=$?"; tail -5 $R/pytest.log
timeout ${PROBE_S:-200} python3 benchmarks/next/index_wg.py $R ${ROUNDS:-3} ${BUDGET:-170} > $R/index_wg.log 2>&1
echo "probe rc=$?"; cat $R/index_wg.log | tail -40
if [ -n "$NCU" ] && [ "${NCU_S:-120}" != 0 ]; then
  timeout ${NCU_S:-120} $NCU --clock-control none -k 'regex:index_scores' --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 benchmarks/next/index_wg.py --ncu "tl 2x64 (default)" > $R/ncu_tl.txt 2>&1
  echo "ncu tl rc=$?"
  timeout ${NCU_S:-120} $NCU --clock-control none -k 'regex:index_scores' --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 benchmarks/next/index_wg.py --ncu "wg2 s3" > $R/ncu_wg2.txt 2>&1
  echo "ncu wg2 rc=$?"
  grep -E "Duration|Throughput|Pipe|Issue|Occupancy|Registers|Stall|Executed Ipc|Shared" $R/ncu_tl.txt | head -40
  grep -E "Duration|Throughput|Pipe|Issue|Occupancy|Registers|Stall|Executed Ipc|Shared" $R/ncu_wg2.txt | head -40
fi
date -u
