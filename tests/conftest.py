"""Test setup: Triton kernels run under the CPU interpreter when no CUDA device is present."""

import os
import shutil

import pytest

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup`` (``make test``): one xdist group per test file, so a file's
    module fixtures are built once; test_precision.py's slow tests spread one per group; every test that
    starts a vLLM server in one group, queued first (the longest chain, and one server at a time)."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    for item in items:
        if item.get_closest_marker("vllm"):
            group = "vllm"
        elif item.path.name == "test_precision.py":
            group = item.nodeid.replace("@", "_")
        else:
            group = item.path.relative_to(config.rootpath).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)


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
