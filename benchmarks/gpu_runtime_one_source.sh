#!/usr/bin/env bash
# One H200 call for issue 13 item 6 and issue 14's GPU line:
#  1. `adapt bench runtime`, gpt-oss-120b then DeepSeek-V3.2 width at batch 1, 16 and 64 (all 12 rows),
#     one process (ceilings once), the report rewritten after every batch;
#  2. the one-source numbers on the GPU, after part 1 (never beside it: it would share the GPU with the
#     timed steps): engine greedy tokens and prefill logits of tiny-dsa and tiny-oss (float32,
#     --kernels none and all) and stage 3 (`run_kernel_tests(dir, "h200", device="cuda")`) on the same
#     tiny models, for every export under trees/<commit>/ (older commits: `git archive <commit> adapt`)
#     and for this checkout, one process per tree, all at once (numbers only, nothing timed).
# Usage (repo root, GPU machine): ADAPT_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_runtime_one_source.sh
# RT_S: seconds for part 1 (default 150); END_S: second at which part 2 is stopped (default 228).
# CPU dry run of the same flow: RT_ARGS="--device cpu --tiny -b 1 --prompt-tokens 8 --decode-steps 1"
# OS_ARGS="--device cpu --target cpu".
# Files under $OUT (at most 8): session.log, runtime_bench.json, runtime_bench.md, one_source_<tree>.json.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
REPO=$(pwd)
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; df -h /dev/shm | tail -1
echo "== 1. runtime"
RT_S=${RT_S:-150}
timeout "$RT_S" env PYTHONPATH=. python3 -m adapt.cli bench runtime -m gpt-oss-120b -m deepseek-v3.2 \
  --budget-s $((RT_S - 10)) -o /tmp/rt --json ${RT_ARGS:-} > /tmp/rt_stdout.json
echo "runtime rc=$? at $(($(date +%s) - T0)) s"
cp /tmp/rt/runtime_bench.json /tmp/rt/runtime_bench.md "$OUT/" 2>/dev/null
echo "== 2. one-source numbers"
left=$((${END_S:-228} - ($(date +%s) - T0)))
pids=()
for tree in trees/* .; do
  name=$([ "$tree" = . ] && echo "${ADAPT_COMMIT:-head}" || basename "$tree")
  (cd "$tree" && timeout "$left" env PYTHONPATH=. python3 "$REPO/benchmarks/one-source/measure_before_after.py" \
     "$OUT/one_source_$name.json" tiny-dsa tiny-oss ${OS_ARGS:---device cuda --target h200} --engine tiny-dsa tiny-oss \
     > "/tmp/one_source_$name.log" 2>&1; echo "tree $name rc=$? at $(($(date +%s) - T0)) s") &
  pids+=($!)
done
wait "${pids[@]}"   # not a bare wait: that would also wait for the tee behind exec
for log in /tmp/one_source_*.log; do echo "-- $log"; grep -v "Writing model shards" "$log" | tail -8; done
date -u
