#!/usr/bin/env bash
# Session 18, call 6 (issue 16): the padded tile table's Triton program on the GPU (tests against the torch form, the
# chunked index_topk against the twin), the host's share (index_host.py), then the full acceptance at main's defaults
# with SM clock and power logged.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s18c6}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
timeout ${TEST_S:-120} python3 -m pytest -q -x -m gpu -p no:cacheprovider -k "padded_tile or deepseek_v32_shapes or match_twin" \
  tests/kernels/test_dsa.py tests/kernels/test_dsa_gluon.py > $R/pytest.log 2>&1
echo "pytest rc=$?"; tail -2 $R/pytest.log
timeout ${HOST_S:-120} python3 benchmarks/next/index_host.py $R ${ROUNDS:-3} > $R/index_host.log 2>&1
echo "index_host rc=$?"; tail -8 $R/index_host.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 500 > $R/smi.csv 2>&1 &
SMI=$!
if [ "${ACC_S:-280}" != 0 ]; then
  timeout ${ACC_S:-280} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep > $R/dsa.log 2>&1
  echo "acceptance rc=$?"; grep -E "MET|prefill T|decode  B|^ *[0-9]+ x|131072" $R/dsa.log | tail -14
fi
kill $SMI
date -u
