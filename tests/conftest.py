"""Test setup: Triton kernels run under the CPU interpreter when no CUDA device is present."""

import os
import shutil

import pytest

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"


def _interpret_nested_calls_in_the_patched_language():
    """Triton's interpreter (3.x) re-patches triton.language on every call of a @triton.jit helper from a kernel
    (``InterpretedFunction.__call__`` runs ``_patch_lang``: inspect.getmembers over the language modules; 45% of
    test_precision.py's time on 2 cores, 2026-12-03) although the kernel's launch has patched them for its whole
    grid and restores them after it. A helper whose language modules are patched already runs as the
    interpreter runs it, without that step; any other call (a module the launch did not patch, or outside a
    launch) goes through the interpreter's own ``__call__``. Same semantics: the step re-sets what is set."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    call = interpreter.InterpretedFunction.__call__
    body = inspect.getsource(call)
    if not ("_patch_lang(self.fn)" in body and "fn = self.rewrite()" in body and "InterpreterError" in body):
        return  # another interpreter: leave it as it is
    langs_of: dict = {}

    def nested_call(self, *args, **kwargs):
        langs = langs_of.get(self.fn)
        if langs is None:
            langs = langs_of[self.fn] = [v for v in self.fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (tl, tl.core)]
        if not langs or any(tl.core.is_builtin(lang.load) for lang in langs):
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = nested_call


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_nested_calls_in_the_patched_language()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test that starts a vLLM server first (the longest chain), in collection order otherwise (a stable sort,
    the same in every xdist worker). ``make test`` distributes whole files (``--dist loadfile``), so a file's module
    fixtures are built once. (``--dist loadgroup`` cannot group them with pytest 9.2: xdist 3.8 names an item's group
    by rewriting ``item._nodeid``, which pytest 9's ``nodeid`` no longer reads, so each test went its own way and a
    module's vLLM server was started once per worker.)"""
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
