"""Fixtures shared by the memory and parallel stage tests: preset specs and targets."""

import pytest

from adapt.model.spec import load_spec
from adapt.targets.target import load_target


@pytest.fixture(scope="module")
def specs():
    return {
        name: load_spec(name) for name in ("gpt-oss-120b", "qwen3-30b-a3b", "deepseek-v3.2", "mixtral-8x7b")
    }


@pytest.fixture(scope="module")
def h100():
    return load_target("h100-sxm")


@pytest.fixture(scope="module")
def h200():
    return load_target("h200")
