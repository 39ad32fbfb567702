#!/usr/bin/env bash
# Session 14, call 7: gpu tests of this session's DSA changes (node ids); then issue 15's DeepSeek-V3 T = 1 and 64
# beside the peer with the rows timed back to back (bench_moe STEADY_TOKENS; the synced figure beside).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s14c7; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; echo "commit ${ADAPT_COMMIT:-unknown}"; } > $R/call.log 2>&1
cat $R/call.log
timeout ${TESTS_S:-170} python3 -m pytest -v -p no:cacheprovider -m gpu \
  "tests/kernels/test_topk.py::test_grid_select_candidates_loaded_once_past_the_first_block" \
  "tests/kernels/test_sparse_mla_gluon.py::test_batch1_chain_options_pdl_and_bf16_partials" \
  "tests/kernels/test_sparse_mla_gluon.py::test_gluon_kernel_is_the_batch1_default_with_its_slices_merged_at_once" \
  "tests/kernels/test_topk.py::test_grid_select_deepseek_v32_decode_shape_on_gpu" \
  >> $R/call.log 2>&1
echo "tests rc=$?" | tee -a $R/call.log; grep -E "PASSED|FAILED|passed|failed" $R/call.log | tail -6
timeout ${BENCH_S:-90} env PYTHONPATH=.:.peer python3 -m adapt.stages.bench_moe /tmp/moe --peer-only --shapes deepseek-v3 \
  --tokens 1 64 --budget-s $((${BENCH_S:-90} - 10)) --variants planar_combine planar_fused > $R/moe.log 2>&1
echo "moe rc=$?"; cp /tmp/moe/moe_bench.json $R/ 2>/dev/null
python3 - <<'PY'
import json
d = json.load(open("/tmp/moe/moe_bench.json"))
rows = d.get("rows", d) if isinstance(d, dict) else d
for r in rows:
    if isinstance(r, dict) and "time_us" in r:
        print(r.get("shape"), r.get("tokens"), r.get("variant"), round(r["time_us"], 1), "synced", r.get("time_us_synced") and round(r["time_us_synced"], 1),
              "x_floor", r.get("x_floor") and round(r["x_floor"], 3), "copy", r.get("copy_fraction") and round(r["copy_fraction"], 3))
PY
date -u | tee -a $R/call.log
