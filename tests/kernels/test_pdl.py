"""Programmatic dependent launch (``adapt.kernels.pdl``): on by default where it applies, never without a CUDA
device; a chain kernel built with PDL for sm_90 waits for the kernel before and lets the next one launch (PTX), with
Triton's ``launch_pdl`` in its metadata. Compiled on the CPU (ptxas from the triton wheel), no device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapt.kernels import pdl

ROOT = Path(__file__).resolve().parents[2]
BUILD = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adapt.kernels import topk
kern = topk._digit_pick_kernel
for on in (True, False):
    const = {"BITS": 8, "PASS": 0, "PDL": on}
    sig = {n: "constexpr" if n in const else "*i32" if n.endswith("_ptr") else "i32" for n in kern.arg_names}
    k = triton.compile(ASTSource(kern, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 1, "launch_pdl": on})
    print(json.dumps({"on": on, "ptx": k.asm["ptx"], "launch_pdl": bool(k.metadata.launch_pdl)}))
"""


@pytest.mark.slow
def test_chain_kernel_with_pdl_waits_then_releases_the_next():
    # built in a process without the interpreter (the suite's kernels run interpreted on the CPU)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, env=env, timeout=600)
    rows = {r["on"]: r for r in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {True, False}, run.stdout + run.stderr
    ptx = rows[True]["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")
    assert rows[True]["launch_pdl"]
    assert "griddepcontrol" not in rows[False]["ptx"] and not rows[False]["launch_pdl"]


def test_pdl_never_applies_on_the_cpu_and_can_be_turned_off():
    previous = pdl.set_enabled(True)
    try:
        assert not pdl.active(torch.device("cpu"))  # no CUDA device: never, enabled or not
        assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
        assert pdl.set_enabled(False) is True
        assert not pdl.active(torch.device("cuda", 0))  # turned off: no device query at all
    finally:
        pdl.set_enabled(previous)


def test_pdl_default_follows_the_environment():
    env = {k: v for k, v in os.environ.items() if k != "ADAPT_PDL"}
    env["PYTHONPATH"] = str(ROOT)
    code = "from adapt.kernels import pdl; print(pdl._ENABLED)"
    for value, want in ((None, "True"), ("0", "False")):
        run_env = dict(env, **({} if value is None else {"ADAPT_PDL": value}))
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=300)
        assert got.stdout.strip() == want, (value, got.stdout, got.stderr)


def test_zero_rows_kernel_clears_every_row():
    # the radix select's histogram zeroing when it runs in the PDL chain (here without PDL, on the interpreter)
    from adapt.kernels import topk

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the interpreter or a GPU")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hist = torch.full((3, 256), 7, dtype=torch.int32, device=dev)
    topk._zero_rows_kernel[(3,)](hist, WIDTH=256, num_warps=1)
    assert int(hist.abs().sum()) == 0
