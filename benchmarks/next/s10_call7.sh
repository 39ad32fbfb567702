#!/usr/bin/env bash
# Session 10, call 7 (issue 16): benchmarks/next/pdl_probe.py (the batch-1 decode step with programmatic dependent
# launch off and on), then the top-k and sparse MLA gpu tests with ADAPT_PDL=1.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s10c7; mkdir -p $R
timeout "${PROBE_S:-150}" python3 benchmarks/next/pdl_probe.py $R/pdl_probe.json > $R/pdl_probe.log 2>&1
echo "probe rc=$?"; tail -8 $R/pdl_probe.log
if [ "${TESTS_S:-120}" != 0 ]; then
  ADAPT_PDL=1 timeout "${TESTS_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/kernels/test_topk.py \
    tests/kernels/test_dsa.py tests/kernels/test_sparse_mla.py > $R/pytest_gpu_pdl.log 2>&1
  echo "rc=$?" >> $R/pytest_gpu_pdl.log; tail -4 $R/pytest_gpu_pdl.log
fi
tar czf $OUT/s10c7.tgz -C $OUT s10c7
