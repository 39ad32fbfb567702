#!/usr/bin/env bash
# Session 16, call 3: the bf16 sparse MLA kernel's DEFER_SUM (GPU tests, mla_upconvert.py), then the prefill acceptance
# case at the new defaults (upconvert on, EARLY_WAIT) and with --mla-defer-sum.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s16c3; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${TESTS_S:-150} python3 -m pytest -q -x -m gpu tests/kernels/test_sparse_mla_upconvert.py -p no:cacheprovider > $R/pytest.log 2>&1
echo "pytest rc=$?" | tee -a $R/call.log; tail -4 $R/pytest.log
timeout ${PROBE_S:-200} python3 benchmarks/next/mla_upconvert.py $R ${ROUNDS:-2} > $R/probe.log 2>&1
echo "probe rc=$?" | tee -a $R/call.log; cut -c1-200 $R/probe.log
for v in default defer; do
  flag=""; [ $v = defer ] && flag="--mla-defer-sum"
  timeout ${ACC_S:-150} python3 -m adapt.stages.bench_dsa --out $R/acc_$v --acceptance --no-sweep --prefill-only $flag > $R/dsa_$v.log 2>&1
  echo "dsa $v rc=$?" | tee -a $R/call.log; grep -A1 "prefill T:" $R/dsa_$v.log
done
date -u | tee -a $R/call.log
