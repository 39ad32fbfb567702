#!/usr/bin/env bash
# Session 10, call 6 (issue 15): benchmarks/next/fold_cross.py (planar runtime path vs the Gluon fold, T = 1024-4096).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s10c6; mkdir -p $R
timeout "${PROBE_S:-170}" python3 benchmarks/next/fold_cross.py $R/fold_cross.json $((${PROBE_S:-170} - 20)) > $R/fold_cross.log 2>&1
echo "rc=$?"; python3 -c "
import json; d=json.load(open('$R/fold_cross.json'))
for r in d['rows']: print(f\"{r['shape']:13s} T={r['tokens']:5d} {r['variant']:24s} {r['time_us']:9.1f} us  vs planar {r['vs_planar']:.3f}  {r['tflops']:6.1f} TFLOP/s  eq {r['equal_to_offline']}\")"
tar czf $OUT/s10c6.tgz -C $OUT s10c6
