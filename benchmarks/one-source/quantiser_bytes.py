"""SHA-256 of the bytes and scales every e4m3 quantiser produces on fixed random inputs (and edge
values: zeros, exact 448 * 2**e boundaries and one ulp above, subnormals), so a refactor of the
scale rules can be shown bit-identical. CPU, Triton interpreter for the Triton quantisers.

    PYTHONPATH=. python benchmarks/one-source/quantiser_bytes.py out.json
"""

import hashlib
import json
import sys
from pathlib import Path

from adapt.runtime.engine import prepare_triton

prepare_triton()

import torch  # noqa: E402

from adapt.kernels import dsa, moe_quant  # noqa: E402


def _inputs(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape[:-1], generator=gen)).unsqueeze(-1)
    flat = x.reshape(-1, shape[-1])
    edges = [0.0, 448.0, 224.0, 448.0 * 2.0 ** -10, 1e-40, 3e-39, 1e-4, 0.5e-4]
    for i, v in enumerate(edges[: flat.shape[0]]):
        flat[i] = flat[i] / flat[i].abs().amax().clamp_min(1e-30) * v
    if flat.shape[0] > len(edges):  # one ulp above a boundary
        flat[len(edges), 0] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))
    return x


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.contiguous()
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update((t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int32)).numpy().tobytes())
    return h.hexdigest()


def main(out_path: str) -> None:
    out = {}
    # DSA indexer: queries [N, H=64, D=128], keys [N, 128] (DeepSeek-V3.2; tiny: H=4, D=32)
    for shape in ((37, 64, 128), (64, 128), (9, 4, 32)):
        x = _inputs(shape, 1)
        out[f"dsa.quantize_fp8_rows_torch{shape}"] = _digest(*dsa.quantize_fp8_rows_torch(x))
        out[f"dsa.quantize_fp8_rows{shape}"] = _digest(*dsa.quantize_fp8_rows(x))
    # MoE activations [R, K], per row and per 1x128 group, fp32 and bf16
    for shape in ((33, 256), (17, 384), (5, 7168)):
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(shape, 2).to(dtype)
            for group in (None, 128):
                key = f"{shape}/{dtype}/{group}"
                out[f"moe_quant.quantize_fp8_rows_torch{key}"] = _digest(*moe_quant.quantize_fp8_rows_torch(x, group))
                if shape[1] <= 384:
                    out[f"moe_quant.quantize_fp8_rows{key}"] = _digest(*moe_quant.quantize_fp8_rows(x, group))
    Path(out_path).write_text(json.dumps(out, indent=1))
    for k, v in out.items():
        print(k, v[:16])


if __name__ == "__main__":
    main(sys.argv[1])
