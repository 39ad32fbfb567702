#!/usr/bin/env bash
# Session 9, call 1 (issue 16): the warp-specialised sparse MLA kernel on the H200: its gpu tests (a hang is cut by
# the timeout), then benchmarks/next/mla_ws.py. Results in one tgz under $OUT.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. ADAPT_COMMIT=${ADAPT_COMMIT:-unknown}
R=$OUT/s9c1; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; echo "commit $ADAPT_COMMIT"; } > $R/env.txt 2>&1
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sparse_mla_gluon.py -k "ws" -x > $R/pytest_ws.log 2>&1; echo "rc=$?" >> $R/pytest_ws.log
tail -3 $R/pytest_ws.log
if grep -q "passed" $R/pytest_ws.log && ! grep -q "failed\|rc=124" $R/pytest_ws.log; then
  timeout 300 python3 benchmarks/next/mla_ws.py $R ${MLA_S:-240} > $R/mla_ws.log 2>&1; echo "rc=$?" >> $R/mla_ws.log
  cat $R/mla_ws.log | cut -c1-400
fi
tar czf $OUT/s9c1.tgz -C $OUT s9c1
