#!/usr/bin/env bash
# Session 10, call 4 (issue 15): stream-K planar tiles. The gpu tests of test_moe_stream_k.py, then
# benchmarks/next/sk_probe.py (both shapes, T = 64, 16, 256, 1, 1024: the table's tiles and the s10_* rows in turns).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s10c4; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
timeout "${TESTS_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_stream_k.py > $R/pytest_gpu.log 2>&1
echo "rc=$?" >> $R/pytest_gpu.log; tail -4 $R/pytest_gpu.log
timeout "${PROBE_S:-240}" python3 benchmarks/next/sk_probe.py $R/sk_probe.json $((${PROBE_S:-240} - 20)) > $R/sk_probe.log 2>&1
echo "probe rc=$?"; python3 -c "
import json; d=json.load(open('$R/sk_probe.json'))
print(d['ceilings'].get('copy_tbps'))
for r in d['rows']: print(f\"{r['shape']:13s} T={r['tokens']:5d} {r['variant']:14s} {r['time_us']:9.1f} us  of copy {r['copy_fraction']:.3f}  vs table {r['vs_table']:.3f}  err {r['rel_err']:.1e}\")"
date -u
tar czf $OUT/s10c4.tgz -C $OUT s10c4
