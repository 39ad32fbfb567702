"""Checkpoint weights for the runtime: read only the tensors a run needs, keep their stored formats.

``WeightStore`` opens a model directory through ``adapt.model.checkpoint.Checkpoint`` (headers
only), optionally narrowed to some decoder layers (``select``), and reads one tensor at a time
from its byte span in the shard. Formats stay as stored:

- dense projections: ``Linear`` holds the stored tensor (bf16 / fp32), or e4m3 with its
  ``weight_scale_inv`` block scales (fp8 block checkpoints, 128 x 128 blocks); ``apply_linear``
  dequantizes one matrix transiently for the matmul;
- routed experts: ``Experts`` holds either a stacked [E, ...] tensor of the stored dtype (bf16,
  or e4m3 with block scales) built once from per-expert tensors, or the MXFP4 ``MoEWeights``
  (``*_blocks`` / ``*_scales``, packed) of a fused-expert checkpoint. ``Experts.expert(e)``
  dequantizes one expert for the torch reference path; no full-precision copy of all experts
  is made.

Execution layout: gate and up rows of an expert's first matrix are stacked as [2I, H]; gpt-oss
interleaves them (row 2i gate, 2i + 1 up), every other family stores gate rows then up rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from adapt.errors import InputError
from adapt.model.checkpoint import Checkpoint

FP8_BLOCK = 128
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


@dataclass
class Linear:
    """A projection y = x W^T (+ b) as stored.

    weight: [out, in], bf16 / fp16 / fp32, or float8_e4m3fn with ``scale``
    scale: fp32 [ceil(out / 128), ceil(in / 128)] block scales (weight_scale_inv), or None
    bias: [out] or None
    """

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``dtype`` [out, in] (fp8 blocks multiplied by their scales)."""
        if self.scale is None:
            return self.weight.to(dtype)
        return dequantize_fp8_blocks(self.weight, self.scale).to(dtype)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.weight, self.scale, self.bias) if t is not None
        )


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 weight [..., N, K] times block scales [..., ceil(N/128), ceil(K/128)] -> fp32 [..., N, K]."""
    n, k = weight.shape[-2:]
    expanded = scale.float().repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
    expanded = expanded.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return weight.float() * expanded


# The two E2M1 values of every packed byte (low nibble first), OCP MX v1.0.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BYTE_PAIRS = torch.tensor([[_E2M1[b & 15], _E2M1[b >> 4]] for b in range(256)], dtype=torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 packed uint8 [..., K/2] with E8M0 scales uint8 [..., K/32] -> ``dtype`` [..., K].

    One table lookup per byte (both nibbles at once); scale 2**(s - 127). Same values as
    ``adapt.kernels.mxfp4.dequantize_mxfp4_torch`` (NaN scales are rejected at load).
    """
    *lead, half = packed.shape
    values = _BYTE_PAIRS.to(packed.device)[packed.int()].view(*lead, half // 16, 32)
    values = values * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.view(*lead, half * 2).to(dtype)


def apply_linear(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype."""
    weight = linear.dense(x.dtype)
    bias = None if linear.bias is None else linear.bias.to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


@dataclass
class Experts:
    """One MoE layer's routed experts.

    Stacked form (``mxfp4`` None): gate_up [E, 2I, H] and down [E, H, I] as stored (bf16 / fp32,
    or e4m3 with gate_up_scale [E, ceil(2I/128), ceil(H/128)] and down_scale
    [E, ceil(H/128), ceil(I/128)]); optional biases gate_up_bias [E, 2I], down_bias [E, H].
    MXFP4 form: ``mxfp4`` is an ``adapt.kernels.moe_gemm.MoEWeights`` (packed blocks and E8M0
    scales, biases inside) and the stacked fields are None; after ``to_planar`` (the kernel path, at load)
    ``planar`` (``adapt.kernels.moe_planar.PlanarExperts``) holds the same bytes in the planar layout and
    ``mxfp4`` is None, so the layer keeps one MXFP4 copy.
    interleaved: gate/up rows alternate (gpt-oss) instead of gate rows then up rows.
    """

    count: int
    interleaved: bool
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    mxfp4: object | None = None
    planar: object | None = None

    def to_planar(self):
        """Replace the MXFP4 tensors by their planar copy (``PlanarExperts``, load time) and return it: the
        layout the planar GEMMs read (``moe_planar.planar_to_fp8`` also converts it into an FP8 workspace); the
        torch path and ``expert_mxfp4`` unpack one expert from it when asked."""
        if self.planar is None:
            from adapt.kernels.moe_planar import PlanarExperts

            self.planar = PlanarExperts.from_weights(self.mxfp4)
            self.mxfp4 = None
        return self.planar

    def expert_mxfp4(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Expert ``index`` of an MXFP4 layer as stored (w1 packed [2I, H/2], w1 scales [2I, H/32], w2 packed
        [H, I/2], w2 scales [H, I/32], rows in the checkpoint's gate/up order); None for other formats."""
        if self.mxfp4 is not None:
            w = self.mxfp4
            return w.w1_packed[index], w.w1_scales[index], w.w2_packed[index], w.w2_scales[index]
        if self.planar is None:
            return None
        p1, s1, p2, s2 = self.planar.expert_mxfp4(index)  # gate/up rows interleaved
        if not self.interleaved:
            p1, s1 = torch.cat((p1[0::2], p1[1::2])), torch.cat((s1[0::2], s1[1::2]))
        return p1, s1, p2, s2

    def expert(
        self, index: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Expert ``index`` dequantized to ``dtype``: (gate_up [2I, H], down [H, I], gate_up_bias [2I] | None,
        down_bias [H] | None)."""
        if self.mxfp4 is not None or self.planar is not None:
            p1, s1, p2, s2 = self.expert_mxfp4(index)
            gate_up = dequantize_mxfp4(p1, s1, dtype)
            down = dequantize_mxfp4(p2, s2, dtype)
            if self.mxfp4 is not None:
                b1, b2 = self.mxfp4.w1_bias, self.mxfp4.w2_bias
            else:  # the planar copy keeps fp32 biases, GEMM1's interleaved
                b1, b2 = self.planar.w1_bias, self.planar.w2_bias
                if b1 is not None and not self.interleaved:
                    b1 = torch.cat((b1[:, 0::2], b1[:, 1::2]), dim=1)
            b1 = None if b1 is None else b1[index].to(dtype)
            b2 = None if b2 is None else b2[index].to(dtype)
            return gate_up, down, b1, b2
        if self.gate_up_scale is not None:
            gate_up = dequantize_fp8_blocks(self.gate_up[index], self.gate_up_scale[index]).to(dtype)
            down = dequantize_fp8_blocks(self.down[index], self.down_scale[index]).to(dtype)
        else:
            gate_up, down = self.gate_up[index].to(dtype), self.down[index].to(dtype)
        b1 = None if self.gate_up_bias is None else self.gate_up_bias[index].to(dtype)
        b2 = None if self.down_bias is None else self.down_bias[index].to(dtype)
        return gate_up, down, b1, b2

    @property
    def kernel_format(self) -> str | None:
        """The format adapt's grouped MoE kernels read these experts in: 'mxfp4', 'fp8_block' or 'bf16'
        (None: stored in a dtype the kernels do not take, fp16 / fp32)."""
        if self.mxfp4 is not None or self.planar is not None:
            return "mxfp4"
        if self.gate_up_scale is not None:
            return "fp8_block"
        return "bf16" if self.gate_up.dtype == torch.bfloat16 else None

    def kernel_weights(self):
        """The experts as the grouped kernels take them, without a copy: the MXFP4 ``MoEWeights`` (or their
        ``PlanarExperts`` after ``to_planar``), or a ``StackedExperts`` over the stacked bf16 / FP8 tensors (block
        scales as fp32)."""
        if self.planar is not None:
            return self.planar
        if self.mxfp4 is not None:
            return self.mxfp4
        from adapt.kernels.moe_weights import StackedExperts

        fp8 = self.gate_up_scale is not None
        return StackedExperts(
            self.gate_up,
            self.down,
            self.gate_up_scale.float() if fp8 else None,
            self.down_scale.float() if fp8 else None,
            self.gate_up_bias,
            self.down_bias,
            self.interleaved,
        )

    @property
    def nbytes(self) -> int:
        if self.planar is not None:
            return self.planar.nbytes()
        if self.mxfp4 is not None:
            return self.mxfp4.nbytes()
        parts = (
            self.gate_up,
            self.down,
            self.gate_up_scale,
            self.down_scale,
            self.gate_up_bias,
            self.down_bias,
        )
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


class WeightStore:
    """Lazy, per-tensor access to a checkpoint directory's weights.

    layers: None for the whole model, a count N (layers 0..N-1) or explicit layer indices;
    tensors of other decoder layers are never read. ``bytes_read`` counts tensor bytes loaded.
    """

    def __init__(
        self,
        directory: str | Path,
        layers: int | Iterable[int] | None = None,
        device: torch.device | str = "cpu",
    ):
        self.directory = Path(directory)
        checkpoint = Checkpoint.open(self.directory)
        if layers is not None:
            checkpoint = checkpoint.select(layers if isinstance(layers, int) else list(layers))
        self.checkpoint = checkpoint
        self.device = torch.device(device)
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.checkpoint.tensors

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` as stored (dtype and shape), on the store's device.

        The bytes are read straight into the tensor's memory (no memory map, so the page cache
        of a huge shard never counts toward this process's resident memory).
        """
        info = self.checkpoint.tensors.get(name)
        if info is None:
            raise InputError(
                f"tensor '{name}' is missing from the checkpoint",
                file=self.directory,
                hint="is the directory complete, and does config.json describe it?",
            )
        dtype = SAFETENSORS_DTYPES.get(info.dtype)
        if dtype is None:
            raise InputError(
                f"tensor '{name}' has dtype {info.dtype}, which the runtime cannot hold",
                file=self.directory / info.shard,
            )
        tensor = torch.empty(info.shape, dtype=dtype)
        view = tensor.reshape(-1).view(torch.uint8).numpy()
        with open(self.directory / info.shard, "rb") as handle:
            handle.seek(info.file_start)
            got = handle.readinto(view)
        if got != info.nbytes or view.nbytes != info.nbytes:
            raise InputError(
                f"tensor '{name}': read {got} of {info.nbytes} bytes",
                file=self.directory / info.shard,
                hint="the shard is truncated",
            )
        self.bytes_read += info.nbytes
        return tensor.to(self.device)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None

    def linear(self, prefix: str, bias: bool | None = None) -> Linear:
        """The projection ``prefix`` (``prefix.weight`` [+ ``weight_scale_inv``] [+ ``bias``]).

        bias: True requires ``prefix.bias``, False ignores it, None reads it when present.
        """
        weight = self.get(f"{prefix}.weight")
        scale = self.optional(f"{prefix}.weight_scale_inv")
        if weight.dtype == torch.float8_e4m3fn and scale is None:
            raise InputError(f"fp8 tensor '{prefix}.weight' has no weight_scale_inv", file=self.directory)
        if bias is None:
            bias_tensor = self.optional(f"{prefix}.bias")
        else:
            bias_tensor = self.get(f"{prefix}.bias") if bias else None
        return Linear(weight, scale, bias_tensor)

    def experts(self, prefix: str, count: int, interleaved: bool) -> Experts:
        """Routed experts under ``prefix`` (e.g. 'model.layers.3.mlp.experts').

        Recognised layouts: fused MXFP4 (``gate_up_proj_blocks`` / ``_scales`` [E, 2I, H/32(, 16)],
        ``down_proj_blocks`` / ``_scales``, optional ``*_bias``); fused bf16 in transformers' gpt-oss
        layout (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H], moved to [E, out, in] once);
        per-expert ``{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral: ``{e}.w1`` / ``w3`` / ``w2``;
        bf16, or fp8 with ``weight_scale_inv``), stacked once.
        """
        if self.has(f"{prefix}.gate_up_proj_blocks"):
            from adapt.kernels.moe_gemm import MoEWeights

            weights = MoEWeights(
                w1_blocks=self.get(f"{prefix}.gate_up_proj_blocks"),
                w1_scales=self.get(f"{prefix}.gate_up_proj_scales"),
                w2_blocks=self.get(f"{prefix}.down_proj_blocks"),
                w2_scales=self.get(f"{prefix}.down_proj_scales"),
                w1_bias=self.optional(f"{prefix}.gate_up_proj_bias"),
                w2_bias=self.optional(f"{prefix}.down_proj_bias"),
                gate_up_interleaved=interleaved,
            )
            weights.validate()
            if weights.n_experts != count:
                raise InputError(
                    f"{weights.n_experts} experts stored under '{prefix}', config says {count}",
                    file=self.directory,
                )
            return Experts(count=count, interleaved=interleaved, mxfp4=weights)
        if self.has(f"{prefix}.gate_up_proj"):
            return Experts(
                count=count,
                interleaved=interleaved,
                gate_up=self.get(f"{prefix}.gate_up_proj").transpose(1, 2).contiguous(),
                down=self.get(f"{prefix}.down_proj").transpose(1, 2).contiguous(),
                gate_up_bias=self.optional(f"{prefix}.gate_up_proj_bias"),
                down_bias=self.optional(f"{prefix}.down_proj_bias"),
            )
        # Mixtral's checkpoints name an expert's gate, down and up projections w1, w2, w3
        names = ("w1", "w3", "w2") if self.has(f"{prefix}.0.w1.weight") else ("gate_proj", "up_proj", "down_proj")
        gate_up, down, gate_up_scale, down_scale = [], [], [], []
        for e in range(count):
            gate = self.linear(f"{prefix}.{e}.{names[0]}", bias=False)
            up = self.linear(f"{prefix}.{e}.{names[1]}", bias=False)
            proj = self.linear(f"{prefix}.{e}.{names[2]}", bias=False)
            gate_up.append(torch.cat([gate.weight, up.weight]))
            down.append(proj.weight)
            if gate.scale is not None:
                gate_up_scale.append(_stack_gate_up_scales(gate, up))
                down_scale.append(proj.scale)
        return Experts(
            count=count,
            interleaved=False,
            gate_up=torch.stack(gate_up),
            down=torch.stack(down),
            gate_up_scale=torch.stack(gate_up_scale) if gate_up_scale else None,
            down_scale=torch.stack(down_scale) if down_scale else None,
        )


def _stack_gate_up_scales(gate: Linear, up: Linear) -> torch.Tensor:
    """Block scales of [gate; up] stacked along the output rows (each part a whole number of blocks)."""
    rows = gate.weight.shape[0]
    if rows % FP8_BLOCK:
        raise InputError(
            f"fp8 expert width {rows} is not a multiple of the {FP8_BLOCK}-row scale block",
            hint="stacking gate and up needs block-aligned widths",
        )
    return torch.cat([gate.scale, up.scale])
