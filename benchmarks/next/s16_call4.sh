#!/usr/bin/env bash
# Session 16, call 4: the DSA acceptance at the session's defaults (decode 1 and 64, prefill 128K; no sweep), then the
# sparse MLA and DSA GPU tests.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s16c4; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${ACC_S:-260} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep > $R/dsa.log 2>&1
echo "dsa rc=$?" | tee -a $R/call.log; tail -22 $R/dsa.log
rm -f $R/acc/dsa_report.json
timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu tests/kernels/test_sparse_mla_upconvert.py tests/kernels/test_sparse_mla_gluon.py tests/kernels/test_sparse_mla.py tests/kernels/test_sparse_mla_prefill.py -p no:cacheprovider > $R/pytest.log 2>&1
echo "pytest rc=$?" | tee -a $R/call.log; tail -4 $R/pytest.log
date -u | tee -a $R/call.log
