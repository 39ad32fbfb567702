"""MoE feed-forward for the runtime: routing as transformers does it, experts by reference or by kernel.

Routers (transformers 5.19 semantics):

- ``deepseek`` (deepseek_v3 / deepseek_v32 / kimi_k2): fp32 logits, sigmoid scores, the
  correction bias added for selection only; groups ranked by the sum of their two best biased
  scores, ``topk_group`` groups kept, top-k experts among them; weights = unbiased scores of the
  chosen experts, divided by their sum (+1e-20) when ``norm_topk_prob``, times
  ``routed_scaling_factor``; shared experts are added for every token.
- ``gpt_oss``: logits = x W^T + b in the compute dtype, top-k logits, softmax over those k.
- ``qwen3``: softmax over all experts in fp32, top-k, renormalised when ``norm_topk_prob``,
  cast to the compute dtype.

Experts: SwiGLU ``silu(gate) * up`` or gpt-oss's clamped form (gate clamped above at ``limit``,
up to +-limit, ``gate * sigmoid(alpha * gate) * (up + 1)``), then down; outputs weighted by the
routing weights and summed per token.

Paths: ``torch`` loops over the experts that received tokens, dequantizing one expert at a time
(MXFP4 or fp8 blocks) to the compute dtype. ``kernel`` runs adapt's kernels: routing and permutation
(``adapt.kernels.routing``), the grouped GEMMs of ``adapt.kernels.moe_gemm.expert_mlp`` (gate_up +
SwiGLU, down) and the weighted combine, whose output is bf16. The experts' format is chosen once, at
load (``Experts.kernel_weights``):

- MXFP4 (gpt-oss): without a workspace the experts move into the planar layout at load
  (``Experts.to_planar``: ``moe_planar.PlanarExperts``, the layout the planar GEMM decodes in a few integer
  ops per word), which replaces the checkpoint's tensors, so the layer holds the MXFP4 bytes once (K padded to
  128), and every call runs ``moe_planar.planar_moe`` (bf16 activations): the fastest measured MXFP4-storage
  path at T = 1..4096 at both real shapes (benchmarks/moe/2026-11-30-s2, calls 2-4, and 2026-12-02-s10), and at
  T = 16384 in one call 1.28x / 1.33x faster than in slices of 4096 (DeepSeek-V3 23.6-24.0 ms, gpt-oss-120b
  7.3 ms, the peer 23.9-24.3 / 6.9; 2026-12-02-s11). With the shared FP8 workspace the layer keeps the
  checkpoint's MXFP4 tensors (its one copy) and every call runs the workspace path (e4m3 activations, the
  'fp8' expert format of the precision stage): the fastest online path measured at large T (H200, T = 16384:
  DeepSeek-V3 17.3-17.6 ms, gpt-oss-120b 6.3 ms, 2026-12-02-s11). The workspace can convert from the planar
  copy too (``moe_planar.planar_to_fp8``, the same bytes), but that conversion measured 1.7x the word
  conversion's time (8.7 against 5.0 ms at DeepSeek-V3 T = 16384), so the layer does not hold that layout
  with a workspace;
- FP8 with 128 x 128 block scales (DeepSeek-V3/V3.2, Kimi K2): e4m3 weights read as stored, activations
  in e4m3 per 1x128 group, fp8 MMA, each block's partial sum times its scales (DeepSeek-V3's W8A8);
- bf16 (Qwen3, Mixtral, GLM): read as stored, bf16 activations; with the 'fp8' expert format
  (``expert_fp8``) an FP8-block copy of them made at the first kernel call (e4m3, amax / 448 per block).

Only experts stored in fp16 / fp32 have no kernel; ``MoE.kernel_refusal`` says so and they run the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapt.runtime.weights import Experts, Linear, apply_linear


@dataclass(frozen=True)
class RouterSpec:
    """kind: 'deepseek' | 'gpt_oss' | 'qwen3'; top_k experts per token; DeepSeek grouping and scaling."""

    kind: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0


@dataclass
class DenseMLP:
    """gate/up [I, hidden], down [hidden, I]: down(silu(gate x) * up x)."""

    gate: Linear
    up: Linear
    down: Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(F.silu(apply_linear(x, self.gate)) * apply_linear(x, self.up), self.down)


def swiglu(
    gate_up: torch.Tensor, interleaved: bool, clamped: bool, alpha: float, limit: float
) -> torch.Tensor:
    """[T, 2I] -> [T, I]: split gate/up (interleaved rows or halves) and apply the (clamped) SwiGLU."""
    if interleaved:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if not clamped:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoE:
    """One MoE layer: router weight [E, hidden] (+ bias [E] for gpt-oss, + correction bias [E]
    for DeepSeek), routed ``Experts``, optional shared ``DenseMLP``.

    ``forward(x [T, hidden]) -> [T, hidden]``; ``last_topk`` holds the latest (ids int64 [T, k],
    weights fp32 [T, k]) for router capture, and, while ``keep_scores`` is set (a capture is
    running), ``last_scores`` the scores the torch path ranks experts by (fp32 [T, E]:
    DeepSeek's biased sigmoid before the group mask, gpt-oss's logits, Qwen3's softmax; None
    otherwise and after a kernel forward).

    Precision variants (``adapt.runtime.variants.configure``): expert_fp8 (the torch path computes
    the FP8 workspace's numerics); test hook fault_expert_scale {expert: factor} (that expert's
    down projection dequantized ``factor`` times too large, torch and kernel paths).
    """

    expert_fp8 = False
    fault_expert_scale: dict[int, float] | None = None

    def __init__(
        self,
        router: RouterSpec,
        gate: Linear,
        experts: Experts,
        *,
        correction_bias=None,
        shared: DenseMLP | None = None,
        clamped: bool = False,
        alpha: float = 1.702,
        limit: float = 7.0,
        path: str = "torch",
        workspace=None,
    ):
        self.router = router
        self.gate = gate
        self.experts = experts
        self.correction_bias = correction_bias
        self.shared = shared
        self.clamped, self.alpha, self.limit = clamped, alpha, limit
        self.path = path if path == "torch" or self.kernel_refusal is None else "torch"
        self.workspace = workspace
        self.planar = None
        if self.path == "kernel" and experts.kernel_format == "mxfp4" and workspace is None:
            self.planar = experts.to_planar()  # the layer's one MXFP4 copy from here on
        self.kernel_experts = experts.kernel_weights() if self.path == "kernel" else None
        self._fp8_copy = None
        self.last_topk: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last_scores: torch.Tensor | None = None
        self.keep_scores = False

    @property
    def kernel_refusal(self) -> str | None:
        """Why adapt's MoE kernel cannot run this layer (None when it can)."""
        if self.experts.kernel_format is None:
            return (f"experts are stored {self.experts.gate_up.dtype} (adapt.kernels.moe_gemm takes MXFP4, "
                    "FP8-block or bf16 experts)")
        return None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64 [T, k], weights [T, k]: fp32 for DeepSeek, else x's dtype)."""
        ids, weights, _ = self.route_with_scores(x)
        return ids, weights

    def route_with_scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``route`` plus the scores it ranks experts by (fp32 [T, E]; DeepSeek's before the group
        mask: groups are ranked by the sum of their two best)."""
        r = self.router
        if r.kind == "deepseek":
            logits = F.linear(x.float(), self.gate.dense(torch.float32))
            scores = logits.sigmoid()
            choice = scores + self.correction_bias.float() if self.correction_bias is not None else scores
            ranked = choice
            if r.n_group > 1:
                t, e = choice.shape
                grouped = choice.view(t, r.n_group, e // r.n_group)
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
                keep = group_scores.topk(r.topk_group, dim=-1, sorted=False).indices
                group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
                expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(t, e).bool()
                choice = choice.masked_fill(~expert_mask, float("-inf"))
            ids = choice.topk(r.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
            if r.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return ids, weights * r.routed_scaling, ranked
        if r.kind == "gpt_oss":
            logits = apply_linear(x, self.gate)
            values, ids = logits.topk(r.top_k, dim=-1)
            return ids, torch.softmax(values, dim=-1, dtype=values.dtype), logits.float()
        logits = apply_linear(x, self.gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        values, ids = probs.topk(r.top_k, dim=-1)
        if r.norm_topk_prob:
            values = values / values.sum(dim=-1, keepdim=True)
        return ids, values.to(logits.dtype), probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "kernel":
            return self._forward_kernel(x)
        ids, weights, scores = self.route_with_scores(x)
        self.last_topk, self.last_scores = (ids, weights.float()), scores if self.keep_scores else None
        out = torch.zeros_like(x)
        hit = torch.unique(ids).tolist()
        inputs = self._expert_inputs(x)
        for e in hit:
            token, slot = torch.where(ids == e)
            y = self._apply_expert(inputs[token], e) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared.forward(x)
        return out

    def _expert_inputs(self, x: torch.Tensor) -> torch.Tensor:
        if not self.expert_fp8:
            return x
        from adapt.runtime.variants import round_fp8_rows

        return round_fp8_rows(x)

    def _apply_expert(self, inputs: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e`` (torch path) on rows ``inputs`` [n, hidden] (already rounded when ``expert_fp8``)."""
        gate_up, down, b1, b2 = self._expert(e, inputs.dtype)
        h = swiglu(F.linear(inputs, gate_up, b1), self.experts.interleaved, self.clamped, self.alpha, self.limit)
        if self.expert_fp8:
            from adapt.runtime.variants import round_fp8_rows

            h = round_fp8_rows(h)
        return F.linear(h, down, b2)

    def expert_forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e`` alone on every row of x [T, hidden], on this layer's path and format -> [T, hidden]
        (an operator-level check: two layers' experts compared on the same rows)."""
        if self.path != "kernel":
            return self._apply_expert(self._expert_inputs(x), e)
        from adapt.kernels.routing import combine, permute_by_expert

        ids = torch.full((x.shape[0], 1), e, dtype=torch.int32, device=x.device)
        perm = permute_by_expert(ids, self.experts.count)
        y = self._expert_mlp(x.to(torch.bfloat16).contiguous(), perm, 1)
        factor = (self.fault_expert_scale or {}).get(e, 1.0)
        ones = torch.full((x.shape[0], 1), factor, dtype=torch.float32, device=x.device)
        return combine(y, ones, perm.slot_pos, None).to(x.dtype)

    def _expert(self, e: int, dtype: torch.dtype):
        """Expert ``e`` as the torch path multiplies it: as stored, or its FP8 fold (``expert_fp8``)."""
        gate_up, down, b1, b2 = self.experts.expert(e, dtype)
        if self.expert_fp8:
            from adapt.runtime.variants import round_fp8_rows

            w = self.experts.expert_mxfp4(e)
            if w is not None:
                from adapt.kernels.mxfp4 import mxfp4_to_fp8_torch

                folded = []
                for packed, scales in ((w[0], w[1]), (w[2], w[3])):
                    f = mxfp4_to_fp8_torch(packed, scales, group_k=None, validate=False)
                    folded.append((f.values.float() * torch.pow(2.0, f.exponents.float())).to(dtype))
                gate_up, down = folded
            else:
                gate_up, down = round_fp8_rows(gate_up), round_fp8_rows(down)
        if self.fault_expert_scale and e in self.fault_expert_scale:
            down = down * self.fault_expert_scale[e]
        return gate_up, down, b1, b2

    def _expert_mlp(self, x: torch.Tensor, perm, top_k: int) -> torch.Tensor:
        """The grouped expert GEMMs on bf16 rows x [T, hidden] in this layer's kernel format -> bf16
        [T * top_k, hidden] in sorted order (see the module docstring)."""
        from adapt.kernels.moe_gemm import expert_mlp
        from adapt.kernels.moe_quant import FP8_GROUP

        weights = self.kernel_experts
        kw = dict(top_k=top_k, activation="swiglu_clamped" if self.clamped else "swiglu", alpha=self.alpha,
                  limit=self.limit)
        if self.experts.kernel_format == "mxfp4":
            if self.workspace is not None:  # converted from the MXFP4 tensors, chunk by chunk
                return expert_mlp(x, perm, weights, workspace=self.workspace, **kw)
            return expert_mlp(x, perm, weights, compute="bf16", planar=self.planar, **kw)
        if weights.format == "bf16" and self.expert_fp8:
            if self._fp8_copy is None:
                from adapt.kernels.moe_weights import fp8_block_copy

                self._fp8_copy = fp8_block_copy(weights)
            weights = self._fp8_copy
        if weights.format == "bf16":
            return expert_mlp(x, perm, weights, compute="bf16", **kw)
        group = weights.hidden % FP8_GROUP == 0 and weights.intermediate % FP8_GROUP == 0
        return expert_mlp(x, perm, weights, compute="fp8", act_quant="group128" if group else "token", **kw)

    def _forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """Routing, permutation, the grouped expert GEMMs and combine from ``adapt.kernels``.

        The router runs as ``gate_logits`` (fp32); gpt-oss's router bias joins as one extra input
        column of ones, so logits = [x, 1] [W, b]^T.
        """
        from adapt.kernels.routing import RouterConfig, combine, gate_logits, permute_by_expert, route

        r = self.router
        config = RouterConfig(
            top_k=r.top_k,
            scoring="sigmoid" if r.kind == "deepseek" else "softmax",
            n_group=r.n_group,
            topk_group=r.topk_group,
            renormalize=r.norm_topk_prob or r.kind == "gpt_oss",
            routed_scaling=r.routed_scaling,
        )
        gate = self.gate.dense(torch.float32)
        gate_in = x.float()
        if self.gate.bias is not None:
            gate_in = torch.cat([gate_in, gate_in.new_ones(x.shape[0], 1)], dim=1)
            gate = torch.cat([gate, self.gate.bias.float()[:, None]], dim=1)
        weights, ids = route(gate_logits(gate_in, gate), config, self.correction_bias)
        self.last_topk, self.last_scores = (ids.long(), weights), None
        if self.fault_expert_scale:  # a down projection k times too large scales its (bias-free) output k times
            for expert, factor in self.fault_expert_scale.items():
                weights = torch.where(ids == expert, weights * factor, weights)
        perm = permute_by_expert(ids, self.experts.count)
        xb = x.to(torch.bfloat16).contiguous()
        if self.planar is not None:  # made only without a workspace
            from adapt.kernels.moe_planar import planar_moe  # routed experts + combine, the faster measured way

            out = planar_moe(xb, perm, self.planar, weights, top_k=r.top_k, activation=2 if self.clamped else 1,
                             alpha=self.alpha, limit=self.limit).to(x.dtype)
        else:
            out = combine(self._expert_mlp(xb, perm, r.top_k), weights, perm.slot_pos, None).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared.forward(x)
        return out
