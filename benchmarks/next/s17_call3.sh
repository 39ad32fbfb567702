#!/usr/bin/env bash
# Session 17, call 3 (issue 16): index_wg.py (the default against tl, the default with the tile tables computed
# ahead: what the per-chunk host sync costs, and the default's stage counts), then the full acceptance run (decode and
# prefill) at main's defaults, and the gpu tests of the indexer.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/${CALL:-s17c3}; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/env.txt 2>&1
cat $R/env.txt
T=tests/kernels/test_dsa_gluon.py
timeout 90 python3 -m pytest -q -x -m gpu -p no:cacheprovider "$T::test_gluon_scores_match_twin_on_gpu[opts15]" \
  "$T::test_gluon_scores_match_twin_on_gpu[opts16]" > $R/pytest_tma.log 2>&1
rc=$?; echo "pytest tma rc=$rc"; tail -2 $R/pytest_tma.log
[ $rc = 0 ] || export INDEX_WG_SKIP=tma
if [ "${PROBE_S:-110}" != 0 ]; then
  timeout ${PROBE_S:-110} python3 benchmarks/next/index_wg.py $R ${ROUNDS:-3} ${BUDGET:-90} > $R/index_wg.log 2>&1
  echo "probe rc=$?"; grep -v '^{"variant"' $R/index_wg.log | tail -20
fi
if [ "${ACC_S:-280}" != 0 ]; then
  timeout ${ACC_S:-280} python3 -m adapt.stages.bench_dsa --out $R/acc --acceptance --no-sweep > $R/dsa.log 2>&1
  echo "acceptance rc=$?"; grep -E "MET|prefill T|decode  B|^ *[0-9]+ x|131072" $R/dsa.log | tail -14
fi
if [ "${TEST_S:-90}" != 0 ]; then
  timeout ${TEST_S:-90} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernels/test_dsa_gluon.py \
    tests/kernels/test_dsa.py > $R/pytest.log 2>&1
  echo "pytest rc=$?"; tail -2 $R/pytest.log
fi
date -u
