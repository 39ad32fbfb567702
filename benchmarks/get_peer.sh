#!/usr/bin/env bash
# The MoE benchmark's peer, OpenAI's triton_kernels, as vLLM ships it: vLLM's wheels vendor triton's
# python/triton_kernels at tag v3.6.0 as vllm/third_party/triton_kernels (the wheels of 0.26.0, 0.29.0 and 0.33.0 hold
# the same 40 files). Unpacked into the git-ignored .peer/triton_kernels; `bench_moe` imports it with PYTHONPATH=.peer
# (on the GPU machine: carry ".peer"). Needs PyPI; about 300 MB downloaded into a temporary folder, 364 KB kept.
# Usage (repo root): bash benchmarks/get_peer.sh [VLLM_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-0.26.0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps "vllm==$version" -d "$tmp"
python3 - "$tmp" <<'PY'
import glob, pathlib, shutil, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/vllm-*.whl")[0]
prefix = "vllm/third_party/triton_kernels/"
dest = pathlib.Path(".peer/triton_kernels")
staged = pathlib.Path(".peer/triton_kernels.part")
shutil.rmtree(staged, ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
    if not names:
        sys.exit(f"{wheel}: no {prefix} in this wheel; pick another vLLM version")
    for n in names:
        out = staged / n[len(prefix):]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(z.read(n))
shutil.rmtree(dest, ignore_errors=True)
staged.rename(dest)
print(f"{len(names)} files of {pathlib.Path(wheel).name} in {dest}")
PY
