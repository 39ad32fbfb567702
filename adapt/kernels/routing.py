"""MoE routing: fp32 gating, top-k selection, permutation of token slots by expert, weighted combine.

Triton kernels with torch twins of the same signature (``*_torch``).

- ``gate_logits(hidden [T, H], gate_weight [E, H]) -> fp32 [T, E]`` (fp32 matmul, no TF32).
- ``route(logits [T, E] fp32, config, correction_bias [E] | None) -> (weights fp32 [T, k], ids int32 [T, k])``
  scoring ``softmax`` (Mixtral, Qwen3, gpt-oss: softmax over all experts, top-k, renormalise =
  gpt-oss's softmax over the top-k logits) or ``sigmoid`` (DeepSeek-V3: sigmoid scores, the
  correction bias added for selection only, group-limited top-k: groups ranked by the sum of
  their two best biased scores, ``topk_group`` groups kept). Weights are the unbiased scores of the
  chosen experts, renormalised to sum 1 if ``renormalize``, times ``routed_scaling``.
  Ids come in descending order of the selection score.
- ``permute_by_expert(ids [T, k], n_experts) -> Permutation``: a stable sort of the T*k token
  slots (slot = t*k + j) by expert: ``sorted_slot`` [T*k] (slot at each sorted position),
  ``slot_pos`` [T*k] (its inverse), ``expert_offsets`` int32 [E+1].
- ``combine(y [T*k, H] sorted, weights [T, k], slot_pos, shared [T, H] | None) -> [T, H]``:
  out[t] = sum_j weights[t, j] * y[slot_pos[t*k+j]] (+ shared[t]), accumulated in fp32.

Bytes: ``route`` reads 4*E and writes 8*k bytes per token; ``permute_by_expert`` reads the ids
twice and writes 8 bytes per slot; ``combine`` reads k*H*2 (+ H*2) and writes H*2 bytes per token.
FLOPs are negligible beside the expert GEMMs (gating: 2*T*H*E).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapt.errors import InputError
from adapt.kernels import pdl
from adapt.kernels.mxfp4 import to_bf16


@dataclass(frozen=True)
class RouterConfig:
    """How a MoE layer picks experts.

    top_k:          experts per token (k)
    scoring:        'softmax' or 'sigmoid'
    n_group:        expert groups for group-limited routing (1 = none); E % n_group == 0
    topk_group:     groups kept per token (<= n_group)
    renormalize:    divide the chosen weights by their sum
    routed_scaling: factor on the routed weights (DeepSeek-V3: 2.5)
    """

    top_k: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling: float = 1.0

    def validate(self, n_experts: int) -> None:
        """Raise ``InputError`` when the config does not fit ``n_experts`` experts."""
        if self.scoring not in ("softmax", "sigmoid"):
            raise InputError(
                f"unknown router scoring {self.scoring!r}", field="scoring", hint="use 'softmax' or 'sigmoid'"
            )
        if not 1 <= self.top_k <= n_experts:
            raise InputError(f"top_k={self.top_k} must be in [1, {n_experts}]", field="top_k")
        if self.n_group < 1 or n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise InputError(
                f"n_group={self.n_group}, topk_group={self.topk_group} do not fit {n_experts} experts",
                field="n_group",
            )
        if self.n_group > 1 and self.top_k > self.topk_group * (n_experts // self.n_group):
            raise InputError("top_k exceeds the experts in the kept groups", field="top_k")


@dataclass
class Permutation:
    """Token slots (t*k + j) sorted by expert.

    sorted_slot:    int32 [T*k]  slot at each sorted position
    slot_pos:       int32 [T*k]  sorted position of each slot (inverse of sorted_slot)
    expert_offsets: int32 [E+1]  expert e owns sorted positions [offsets[e], offsets[e+1])
    """

    sorted_slot: torch.Tensor
    slot_pos: torch.Tensor
    expert_offsets: torch.Tensor


def gate_logits(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32: hidden [T, H] x gate_weight [E, H] -> [T, E] (TF32 off)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return hidden.float() @ gate_weight.float().t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


# ----------------------------------------------------------------------------------------------
# route
# ----------------------------------------------------------------------------------------------


def route_torch(
    logits: torch.Tensor, config: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``route``: logits fp32 [T, E] -> (weights fp32 [T, k], ids int32 [T, k])."""
    t, e = logits.shape
    config.validate(e)
    logits = logits.float()
    scores = torch.sigmoid(logits) if config.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    if config.n_group > 1:
        grouped = choice.view(t, config.n_group, e // config.n_group)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = group_score.topk(config.topk_group, dim=-1).indices
        mask = torch.zeros(t, config.n_group, dtype=torch.bool, device=logits.device)
        mask.scatter_(1, keep, True)
        mask = mask.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(config.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * config.routed_scaling, ids.int()


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    n_experts,
    routed_scaling,
    E_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    RENORM: tl.constexpr,
):
    """One program per token: scores, group mask, iterative top-k (first index wins ties)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = e < n_experts
    x = tl.load(logits_ptr + t * n_experts + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        z = tl.exp(x - tl.max(x, axis=0))
        scores = z / tl.sum(z, axis=0)
    scores = tl.where(ok, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    if N_GROUP > 1:
        gsz: tl.constexpr = E_PAD // N_GROUP
        grouped = tl.reshape(choice, (N_GROUP, gsz))
        best = tl.max(grouped, axis=1)
        if gsz > 1:
            col = tl.arange(0, gsz)[None, :]
            arg = tl.argmax(grouped, axis=1)
            gscore = best + tl.max(tl.where(col == arg[:, None], float("-inf"), grouped), axis=1)
        else:
            gscore = best
        gi = tl.arange(0, N_GROUP)
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(tl.where(keep, float("-inf"), gscore), axis=0)
            keep = keep | (gi == pick)
        keep_e = tl.reshape(tl.broadcast_to(keep[:, None], (N_GROUP, gsz)), (E_PAD,))
        choice = tl.where(keep_e, choice, float("-inf"))
    kk = tl.arange(0, TOPK_PAD)
    ids = tl.zeros((TOPK_PAD,), tl.int32)
    ws = tl.zeros((TOPK_PAD,), tl.float32)
    for j in tl.static_range(TOPK):
        pick = tl.argmax(choice, axis=0)
        ids = tl.where(kk == j, pick, ids)
        ws = tl.where(kk == j, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), ws)
        choice = tl.where(e == pick, float("-inf"), choice)
    if RENORM:
        ws = ws / tl.sum(ws, axis=0)
    tl.store(w_ptr + t * TOPK + kk, ws * routed_scaling, mask=kk < TOPK)
    tl.store(ids_ptr + t * TOPK + kk, ids, mask=kk < TOPK)


def route(
    logits: torch.Tensor, config: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing in fp32 (see module docstring). logits [T, E] -> (weights [T, k], ids [T, k])."""
    t, e = logits.shape
    config.validate(e)
    k = config.top_k
    e_pad = triton.next_power_of_2(e)
    if config.n_group > 1 and e_pad != e:
        raise InputError(
            f"group-limited routing needs a power-of-two expert count, got {e}", field="n_routed_experts"
        )
    logits = logits.float().contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    if t:
        _route_kernel[(t,)](
            logits,
            bias,
            weights,
            ids,
            e,
            float(config.routed_scaling),
            E_PAD=e_pad,
            TOPK=k,
            TOPK_PAD=triton.next_power_of_2(k),
            SIGMOID=config.scoring == "sigmoid",
            HAS_BIAS=correction_bias is not None,
            N_GROUP=config.n_group,
            TOPK_GROUP=config.topk_group,
            RENORM=config.renormalize,
        )
    return weights, ids


# ----------------------------------------------------------------------------------------------
# permutation
# ----------------------------------------------------------------------------------------------


def permute_by_expert_torch(ids: torch.Tensor, n_experts: int) -> Permutation:
    """Twin of ``permute_by_expert``: stable sort of slots by expert id; ids outside
    [0, n_experts) are dropped (slot_pos -1, sorted_slot -1 past the kept slots)."""
    flat = ids.reshape(-1).long()
    kept = (flat >= 0) & (flat < n_experts)
    key = torch.where(kept, flat, torch.full_like(flat, n_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(n_experts + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = torch.cumsum(counts[:n_experts], 0).int()
    n_kept = int(kept.sum())
    sorted_slot = torch.full_like(order, -1)
    sorted_slot[:n_kept] = order[:n_kept]
    slot_pos = torch.full_like(order, -1)
    slot_pos[order[:n_kept]] = torch.arange(n_kept, device=ids.device)
    return Permutation(sorted_slot.int(), slot_pos.int(), offsets)


@triton.jit
def _chunk_histogram_kernel(ids_ptr, counts_ptr, n, n_experts, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """counts[c, e] = number of slots of chunk c routed to expert e."""
    c = tl.program_id(0)
    i = c * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + i, mask=i < n, other=-1)
    e = tl.arange(0, E_PAD)
    hist = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * n_experts + e, hist, mask=e < n_experts)


@triton.jit
def _chunk_scan_kernel(
    counts_ptr, base_ptr, offsets_ptr, n_chunks, n_experts, ROWS: tl.constexpr, E_PAD: tl.constexpr
):
    """base[c, e] = offsets[e] + slots of expert e in chunks before c; offsets = exclusive cumsum."""
    e = tl.arange(0, E_PAD)
    em = e < n_experts
    total = tl.zeros((E_PAD,), tl.int32)
    for c0 in range(0, n_chunks, ROWS):
        r = c0 + tl.arange(0, ROWS)
        cnt = tl.load(
            counts_ptr + r[:, None] * n_experts + e[None, :],
            mask=(r < n_chunks)[:, None] & em[None, :],
            other=0,
        )
        total += tl.sum(cnt, axis=0)
    start = tl.cumsum(total, axis=0) - total
    tl.store(offsets_ptr + e, start, mask=em)
    tl.store(offsets_ptr + n_experts + e * 0, tl.sum(total, axis=0), mask=e == 0)
    run = start
    for c0 in range(0, n_chunks, ROWS):
        r = c0 + tl.arange(0, ROWS)
        m = (r < n_chunks)[:, None] & em[None, :]
        cnt = tl.load(counts_ptr + r[:, None] * n_experts + e[None, :], mask=m, other=0)
        tl.store(
            base_ptr + r[:, None] * n_experts + e[None, :],
            run[None, :] + tl.cumsum(cnt, axis=0) - cnt,
            mask=m,
        )
        run += tl.sum(cnt, axis=0)


@triton.jit
def _chunk_scatter_kernel(ids_ptr, base_ptr, sorted_ptr, pos_ptr, n, n_experts, BLOCK: tl.constexpr):
    """Each slot goes to base[chunk, expert] + (earlier slots of the same expert in the chunk)."""
    c = tl.program_id(0)
    i = c * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + i, mask=i < n, other=-1)
    ok = (i < n) & (ids >= 0) & (ids < n_experts)
    j = tl.arange(0, BLOCK)
    earlier = (ids[:, None] == ids[None, :]) & (j[None, :] < j[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(base_ptr + c * n_experts + ids, mask=ok, other=0)
    pos = base + rank
    tl.store(sorted_ptr + pos, i, mask=ok)
    tl.store(pos_ptr + i, tl.where(ok, pos, -1), mask=i < n)


PERMUTE_CHUNK = 128
"""Slots per program of the permutation kernels."""


def permute_by_expert(ids: torch.Tensor, n_experts: int) -> Permutation:
    """Stable sort of token slots by expert (Triton, deterministic, no atomics). ids int [T, k].

    A slot whose id lies outside [0, n_experts) is dropped, never sorted into a neighbour: it
    gets slot_pos -1, adds to no expert (expert_offsets[-1] counts the kept slots), sorted_slot
    is -1 past the kept slots, and ``combine`` adds nothing for it. No check syncs with the host,
    so a CUDA graph can hold the call; validate routers upstream where a drop must be an error."""
    flat = ids.reshape(-1).int().contiguous()
    n = flat.numel()
    dev = ids.device
    n_chunks = max(1, triton.cdiv(n, PERMUTE_CHUNK))
    e_pad = triton.next_power_of_2(n_experts)
    counts = torch.empty(n_chunks, n_experts, dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    offsets = torch.empty(n_experts + 1, dtype=torch.int32, device=dev)
    sorted_slot = torch.full((n,), -1, dtype=torch.int32, device=dev)
    slot_pos = torch.empty(n, dtype=torch.int32, device=dev)
    _chunk_histogram_kernel[(n_chunks,)](flat, counts, n, n_experts, BLOCK=PERMUTE_CHUNK, E_PAD=e_pad)
    _chunk_scan_kernel[(1,)](counts, base, offsets, n_chunks, n_experts, ROWS=16, E_PAD=e_pad)
    _chunk_scatter_kernel[(n_chunks,)](flat, base, sorted_slot, slot_pos, n, n_experts, BLOCK=PERMUTE_CHUNK)
    return Permutation(sorted_slot, slot_pos, offsets)


# ----------------------------------------------------------------------------------------------
# combine
# ----------------------------------------------------------------------------------------------


def combine_torch(
    y: torch.Tensor, weights: torch.Tensor, slot_pos: torch.Tensor, shared: torch.Tensor | None = None
) -> torch.Tensor:
    """Twin of ``combine``: y [T*k, H] (sorted) -> bf16 [T, H]; slots with slot_pos -1 add nothing."""
    t, k = weights.shape
    pos = slot_pos.long()
    g = torch.where((pos >= 0)[:, None], y.float()[pos.clamp(min=0)], 0.0).reshape(t, k, -1)
    out = (g * weights.float().unsqueeze(-1)).sum(dim=1)
    if shared is not None:
        out = out + shared.float()
    return out.to(torch.bfloat16)


@triton.jit
def _combine_kernel(
    y_ptr,
    w_ptr,
    pos_ptr,
    shared_ptr,
    out_ptr,
    h,
    TOPK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: one token x BLOCK_H columns."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cm = c < h
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(TOPK):
        p = tl.load(pos_ptr + t * TOPK + j).to(tl.int64)
        w = tl.load(w_ptr + t * TOPK + j)
        acc += w * tl.load(y_ptr + p * h + c, mask=cm & (p >= 0), other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * h + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * h + c, to_bf16(acc), mask=cm)


def combine(
    y: torch.Tensor, weights: torch.Tensor, slot_pos: torch.Tensor, shared: torch.Tensor | None = None
) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs back in token order -> bf16 [T, H]."""
    t, k = weights.shape
    h = y.shape[-1]
    out = torch.empty(t, h, dtype=torch.bfloat16, device=y.device)
    if t:
        bh = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, bh))](
            y,
            weights.float().contiguous(),
            slot_pos,
            shared if shared is not None else y,
            out,
            h,
            TOPK=k,
            HAS_SHARED=shared is not None,
            BLOCK_H=bh,
            **pdl.launch_options(y.device),
        )
    return out
