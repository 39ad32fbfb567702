"""Same-run ceilings of the current CUDA device: HBM read and copy bandwidth, bf16 and fp8 matmul.

Every benchmark quotes its rates beside these, measured in the same run on the same device
(DESIGN.md, "Measuring performance"); a datasheet number is never the denominator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapt.bench.timer import graph_time_us


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = src[i]: one program per BLOCK elements, contiguous (16-byte accesses per thread)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=m, eviction_policy="evict_first"), mask=m)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """out[p] = sum of STEPS * BLOCK int32 words of src (read-only traffic; one word written per program)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(STEPS):
        i = base + s * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + i, mask=i < n, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def measure_ceilings(copy_gib: int = 4, reps: int = 30, matmul_size: int = 8192, matmul_reps: int = 10) -> dict:
    """Ceilings on ``copy_gib`` GiB random bf16 buffers and ``matmul_size``^3 matmuls, medians of
    CUDA-graph replays.

    Keys: ``copy_torch_tbps``, ``copy_triton_w4_tbps``, ``copy_triton_w8_tbps`` (TB/s of bytes read +
    written) and their best ``copy_tbps``; ``read_torch_sum_tbps``, ``read_triton_tbps`` (TB/s of bytes
    read, nothing written but one word per program) and their best ``read_tbps``;
    ``bf16_matmul_tflops`` (torch matmul), ``fp8_matmul_tflops`` (torch ``_scaled_mm``, e4m3, bf16 out);
    ``copy_bytes_each_way``.
    """
    out = _bandwidth(copy_gib, reps)
    m = matmul_size
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m**3
    out["bf16_matmul_tflops"] = flops / graph_time_us(lambda: x @ y, reps=matmul_reps) / 1e6
    xf, yf = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    out["fp8_matmul_tflops"] = flops / graph_time_us(
        lambda: torch._scaled_mm(xf, yf.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        reps=matmul_reps) / 1e6
    return out


def _bandwidth(copy_gib: int, reps: int) -> dict:
    n = copy_gib * (1 << 30) // 2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ai, bi = a.view(torch.int32), b.view(torch.int32)
    block = 4096
    out = {"copy_bytes_each_way": 2 * n}
    out["copy_torch_tbps"] = 4 * n / graph_time_us(lambda: b.copy_(a), reps=reps) / 1e6
    for warps in (4, 8):
        t = graph_time_us(lambda w=warps: _copy_kernel[(triton.cdiv(ai.numel(), block),)](
            ai, bi, ai.numel(), BLOCK=block, num_warps=w), reps=reps)
        out[f"copy_triton_w{warps}_tbps"] = 4 * n / t / 1e6
    if not torch.equal(a[: 1 << 20], b[: 1 << 20]):
        raise RuntimeError("copy kernel wrote wrong data")
    out["copy_tbps"] = max(v for key, v in out.items() if key.startswith("copy_") and key.endswith("_tbps"))
    out["read_torch_sum_tbps"] = 2 * n / graph_time_us(lambda: ai.sum(dtype=torch.int32), reps=reps) / 1e6
    steps = 8
    programs = triton.cdiv(ai.numel(), block * steps)
    partial = torch.empty(programs, dtype=torch.int32, device="cuda")
    t = graph_time_us(lambda: _read_kernel[(programs,)](ai, partial, ai.numel(), BLOCK=block, STEPS=steps,
                                                       num_warps=8), reps=reps)
    out["read_triton_tbps"] = 2 * n / t / 1e6
    # int32 sums wrap: compare modulo 2**32
    if (int(partial.sum(dtype=torch.int64)) - int(ai.sum(dtype=torch.int64))) % 2**32:
        raise RuntimeError("read kernel summed wrong data")
    out["read_tbps"] = max(out["read_torch_sum_tbps"], out["read_triton_tbps"])
    return out
