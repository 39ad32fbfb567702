"""Data formats the kernels and the caches agree on: the KV page size, slot addressing, the FP8
type and its limit, and whether Triton runs under its CPU interpreter. Tensors only, no models.

Slot addressing: token ``p`` of a sequence lives in page ``block_table[p // PAGE_SIZE]`` at offset
``p % PAGE_SIZE``; its slot (row of the flattened [pages * PAGE_SIZE, ...] pool) is
``page * PAGE_SIZE + offset``.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

PAGE_SIZE = 64
"""Tokens per KV page (DSA: 64-token pages, DeepSeek-V3.2's FlashMLA and vLLM's MLA block size)."""

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
"""Largest finite e4m3fn magnitude (OCP FP8 spec: S.1111.110 = 1.75 * 2**8)."""


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device of compute capability 9.x (Hopper: wgmma), where adapt's Gluon kernels
    compile and were timed; the capability is read once per device (dispatch asks on every call)."""
    if device.type != "cuda":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) == 9


def slots_of(block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Cache slots of token ``positions`` (int64 [N]) of one sequence with pages ``block_table`` (int [P])."""
    return block_table.to(torch.int64)[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (no bf16 dots there): the one check.

    Before triton is imported: whether ``TRITON_INTERPRET=1`` is set (triton reads it then). After:
    whether triton's own ``@triton.jit`` helpers were built for the interpreter, which is what
    decides whether kernels can run here (setting the variable later changes nothing).
    """
    if "triton" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET") == "1"
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


def use_interpreter(force: bool = False) -> None:
    """Ask for the Triton interpreter (``TRITON_INTERPRET=1``) before triton is imported; ``force``
    overrides a value already set. No effect on a triton imported earlier (see ``interpreting``)."""
    if force:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
