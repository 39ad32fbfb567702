#!/usr/bin/env bash
# Session 10, call 8 (issue 16): with PDL now on by default, the gpu tests of the kernels in its chain (sparse MLA
# and the indexer first: call 7 reached only the top-k tests and part of the indexer's before its cap).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s10c8; mkdir -p $R
timeout "${TESTS_S:-170}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sparse_mla.py \
  tests/kernels/test_dsa.py > $R/pytest_gpu_pdl_default.log 2>&1
echo "rc=$?" >> $R/pytest_gpu_pdl_default.log; tail -6 $R/pytest_gpu_pdl_default.log
tar czf $OUT/s10c8.tgz -C $OUT s10c8
