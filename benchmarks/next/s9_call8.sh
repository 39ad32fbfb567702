#!/usr/bin/env bash
# Session 9, call 8 (issue 16): the gpu tests of sparse MLA (every Gluon form and the tl kernels) at main's last commit.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
R=$OUT/s9c8; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sparse_mla_gluon.py tests/kernels/test_sparse_mla.py > $R/pytest_gpu.log 2>&1; echo "rc=$?" >> $R/pytest_gpu.log
tail -5 $R/pytest_gpu.log
tar czf $OUT/s9c8.tgz -C $OUT s9c8
