"""Test setup: Triton kernels run under the CPU interpreter when no CUDA device is present."""

import os
import shutil

import pytest

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def vllm_exe():
    """The vllm executable of the serve environment; a failure under CI, a skip elsewhere."""
    from adapt.errors import InputError
    from adapt.handoff.vllm import find_vllm

    try:
        return find_vllm()
    except InputError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"vLLM missing in CI: {exc.line()}")
        pytest.skip(exc.line())
