"""Stage 3: tolerance tests of every adapt kernel the model needs on the target.

Which kernels: the ModelSpec's semantic operators (``adapt.model.operators.ops_from_spec``, no
trace) are classified against the target's stack table (``adapt.targets.support.classify``). An operator
needs a check when the stack provides it through an adapt kernel (status ``adapt_kernel``), or
when the stack lacks it (``missing``) and adapt has a kernel for it (``ADAPT_KERNEL_FOR_OP``).
Native and composable operators are listed as not needing a check.

How each kernel is checked: on small shapes scaled down from the spec (head-count ratios, top-k
against sequences shorter and longer than k, the model's routing rule, activation and
gate/up layout, widths of a few dozen), the Triton kernel is compared with

- its torch twin (the same quantized operands, fp32 math), and
- a float64 reference computed here from the dequantized operands,

as ``||out - ref|| / ||ref||`` over the entries both define. A non-finite output never passes.
Selections (indexer top-k, routed experts) are compared as sets per row: a row agrees when the
sets are equal, or differ only in entries whose reference score ties the k-th score (within
the float32 tolerance of the row's largest score). Quantizers are checked against the float64
values they encode; those thresholds come from the measured quantization error of e4m3 and
MXFP4 on standard-normal data (see ``gates.yaml``, section ``kernels``).

Tolerances by dtype path (gate keys): ``fp32`` math on exact operands -> max_rel_error_fp32;
e4m3 operands multiplied by a GPU's fp8 MMA (its accumulator keeps fewer bits than fp32) ->
max_rel_error_fp8_mma; bf16 operands or outputs -> max_rel_error_bf16; e4m3 quantization of
activations or cache rows -> max_rel_error_fp8; MXFP4 weight encoding -> max_rel_error_mxfp4;
top-k rows that disagree -> max_topk_mismatch_rows.

On a machine without CUDA the kernels run under the Triton interpreter: ``TRITON_INTERPRET=1``
is set before triton is first imported, and the report says so. Triton decides at import time;
when this process imported it earlier without the flag (the CLI's stage 1 imports the kernel
modules), the checks run in a fresh ``python -m adapt.stages.kernels`` with the flag set
(``adapt.runtime.interpreter_process``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapt.errors import InputError
from adapt.kernels.formats import interpreting, use_interpreter
from adapt.model.operators import ops_from_spec
from adapt.model.spec import LayerSpec, ModelSpec, load_spec
from adapt.report import StageReport, fingerprint, load_gates, now_iso
from adapt.runtime.interpreter_process import run_in_interpreter_process, serve_request
from adapt.targets.support import GapRow, classify
from adapt.targets.target import load_stack, load_target

# Semantic operator -> the adapt kernel that implements it, for stacks that lack the operator.
ADAPT_KERNEL_FOR_OP = {
    "dsa_indexer": "adapt.kernels.dsa.index_topk",
    "attention_mla_sparse": "adapt.kernels.sparse_mla.sparse_mla",
    "kv_cache_indexer": "adapt.runtime.kv_cache.PagedKVCache",
    "moe_grouped_gemm_mxfp4": "adapt.kernels.moe_gemm.moe_forward",
    "moe_grouped_gemm_fp8_block": "adapt.kernels.moe_gemm.moe_forward",
    "moe_grouped_gemm_bf16": "adapt.kernels.moe_gemm.moe_forward",
    "mxfp4_decode": "adapt.kernels.mxfp4.dequantize_mxfp4",
    "moe_permute": "adapt.kernels.routing.permute_by_expert",
    "routing_softmax_topk": "adapt.kernels.routing.route",
    "routing_topk_softmax": "adapt.kernels.routing.route",
    "routing_sigmoid_topk": "adapt.kernels.routing.route",
    "routing_sigmoid_group_topk": "adapt.kernels.routing.route",
}
TITLE = "Kernel tolerance tests"
CHILD_TIMEOUT_S = 600
MLA_QUERY_ROWS = 10
GATE_KEYS = {"fp32": "max_rel_error_fp32", "bf16": "max_rel_error_bf16", "fp8": "max_rel_error_fp8",
             "fp8_mma": "max_rel_error_fp8_mma", "mxfp4": "max_rel_error_mxfp4",
             "topk": "max_topk_mismatch_rows"}
# Kernel against its torch twin (same quantized operands): keys of their own, far tighter than the
# format errors above, so a kernel cannot drift from its twin by a format's quantization error.
TWIN_KEYS = {"cpu": "max_twin_rel_error_interpreter", "cuda": "max_twin_rel_error_gpu"}
SEED = 0


@dataclass
class CheckResult:
    """One tolerance check of one kernel.

    op: semantic operator; kernel: the function checked; check: what was compared
    dtype_path: "fp32" | "bf16" | "fp8" | "fp8_mma" | "mxfp4" | "topk" (selects the tolerance)
    twin_error / ref_error: relative L2 error against the torch twin / the float64 reference
        (for "topk": rows whose selection disagrees); None where that comparison does not apply
    tolerance: the format's gate value, applied to ref_error (and to twin_error where no
        twin_tolerance is set: selections, counted in rows)
    twin_tolerance: the kernel-vs-twin gate value (``TWIN_KEYS``: interpreter or GPU)
    passed: each error within its tolerance and every output finite
    """

    op: str
    kernel: str
    check: str
    dtype_path: str
    twin_error: float | None
    ref_error: float | None
    tolerance: float
    finite: bool = True
    detail: str = ""
    twin_tolerance: float | None = None

    def limits(self) -> list[tuple[str, float, float]]:
        """(comparison, error, tolerance) for each comparison made."""
        out = []
        if self.twin_error is not None:
            twin_tol = self.twin_tolerance if self.twin_tolerance is not None else self.tolerance
            out.append(("kernel vs twin", self.twin_error, twin_tol))
        if self.ref_error is not None:
            out.append(("kernel vs float64" if self.dtype_path != "topk" else "kernel vs reference",
                        self.ref_error, self.tolerance))
        return out

    @property
    def passed(self) -> bool:
        return self.finite and all(math.isfinite(e) and e <= tol for _, e, tol in self.limits())

    def row(self) -> dict[str, Any]:
        return {
            "op": self.op, "kernel": self.kernel, "check": self.check,
            "twin rel err": _num(self.twin_error, self.dtype_path),
            "float64 rel err": _num(self.ref_error, self.dtype_path),
            "tolerance": self.tolerance,
            "twin tolerance": self.twin_tolerance if self.twin_tolerance is not None else "-",
            "dtype path": self.dtype_path,
            "result": ("pass" if self.passed else "FAIL") + (f" ({self.detail})" if self.detail else ""),
        }


def _num(value: float | None, path: str) -> Any:
    if value is None:
        return "-"
    if path == "topk":
        return int(value)
    return float(f"{value:.3g}")


@dataclass(frozen=True)
class Shapes:
    """Small shapes scaled down from the spec (sizes in elements, counts in tokens)."""

    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    mla_heads: int = 0
    mla_rank: int = 0
    mla_rope: int = 0
    mla_scale: float = 0.0
    lengths: tuple[int, ...] = ()
    experts: int = 0
    top_k: int = 0
    n_group: int = 1
    topk_group: int = 1
    hidden: int = 64
    intermediate: int = 64
    tokens: int = 24


def _pow2_at_least(value: int, floor: int) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(1, value)))))


def scaled_shapes(spec: ModelSpec) -> Shapes:
    """Shapes for the checks: the spec's head ratios and top-k semantics at widths of tens.

    Indexer heads / 16 and MLA heads / 32 (DeepSeek-V3.2: 64 -> 4, 128 -> 4), index dim / 4 (a
    power of two, at least 16), latent rank / 8 (at least 32), rope / 4 (at least 16); top-k
    index_topk / 128 (at least 8, at most index_topk), checked on one sequence shorter than k and
    one several times longer. Experts: enough for top-k and the groups (at most the model's),
    keeping top_k, n_group and topk_group.
    """
    values: dict[str, Any] = {}
    dsa = next((layer.attention for layer in spec.layers if layer.attention.kind == "mla+dsa"), None)
    if dsa is not None:
        topk = min(dsa.index_topk, max(8, dsa.index_topk // 128))
        values.update(
            index_heads=max(2, dsa.index_n_heads // 16),
            index_dim=_pow2_at_least(dsa.index_head_dim // 4, 16),
            index_topk=topk,
            mla_heads=max(2, dsa.num_heads // 32),
            mla_rank=_pow2_at_least(dsa.kv_lora_rank // 8, 32),
            mla_rope=_pow2_at_least(dsa.qk_rope_head_dim // 4, 16),
            mla_scale=dsa.head_dim ** -0.5,
            lengths=(max(1, topk // 2 + 3), 3 * topk + 5),
        )
    moe = _first_moe(spec)
    if moe is not None:
        ffn = moe.ffn
        experts = min(ffn.num_experts, max(2 * ffn.top_k, 4 * ffn.n_group, 8))
        experts -= experts % ffn.n_group
        values.update(experts=experts, top_k=ffn.top_k, n_group=ffn.n_group, topk_group=ffn.topk_group)
    return Shapes(**values)


def _first_moe(spec: ModelSpec) -> LayerSpec | None:
    return next((layer for layer in spec.layers if layer.ffn.kind == "moe"), None)


# ---------------------------------------------------------------- interpreter


def interpreter_state() -> str:
    """How Triton kernels can run in this process on a machine without CUDA.

    "interpreter": TRITON_INTERPRET=1 is set and triton is not imported yet, or was imported
    with it (set here when needed); "compiled": triton was already imported without it, so its
    own ``@triton.jit`` helpers cannot be interpreted in this process.
    """
    if "triton" not in sys.modules:
        use_interpreter(force=True)
    return "interpreter" if interpreting() else "compiled"


def _child_main() -> None:
    """``python -m adapt.stages.kernels``: the interpreter process of ``run_in_interpreter_process``."""
    serve_request(lambda r: run_kernel_tests(r["model"], r["target"], stack=r["stack"], gates=r["gates"],
                                             device="cpu"))


# ---------------------------------------------------------------- comparisons


def rel_error(out, ref, mask=None) -> float:
    """||out - ref|| / ||ref|| in float64 over ``mask`` (all entries when None); inf when ``out``
    has a non-finite entry there; 0 when both are zero."""
    import torch

    a, b = out.double().cpu(), ref.double().cpu()
    if mask is not None:
        a, b = a[mask.cpu()], b[mask.cpu()]
    if not torch.isfinite(a).all():
        return math.inf
    norm = float(b.norm())
    diff = float((a - b).norm())
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)


def twin_error(got, twin_fp32, slack: float) -> float:
    """``rel_error`` of a kernel's bf16/fp16 output against its twin's fp32 result rounded to that
    dtype, where an entry one step of the format away counts as equal only when the twin's fp32
    value lies within ``slack`` (relative) of the midpoint of the two: the same fp32 arithmetic
    summed in another order rounds to the other neighbour there. Every other difference (a
    systematic drift below one step included) counts in full."""
    import torch

    a, t = got.double().cpu(), twin_fp32.double().cpu()
    r = twin_fp32.to(got.dtype).double().cpu()
    _, exponent = torch.frexp(torch.maximum(a.abs(), r.abs()))
    step = torch.ldexp(torch.full_like(a, torch.finfo(got.dtype).eps / 2), exponent)  # eps * 2^(e-1)
    at_midpoint = (t - (a + r) / 2).abs() <= slack * t.abs()
    neighbours = torch.isfinite(a) & ((a - r).abs() <= step) & at_midpoint
    return rel_error(torch.where(neighbours, r, a), r)


def topk_mismatch_rows(got, ref_scores, k: int, tie_tol: float) -> int:
    """Rows whose selected set is not a valid top-k of ``ref_scores``.

    got: int [N, k] selected columns (-1 = none); ref_scores: float64 [N, S], -inf where not
    visible. A row is valid when it holds min(k, visible) distinct visible columns, -1 in the
    rest, and every selected score is at least the k-th largest score minus ``tie_tol`` times
    the row's largest magnitude (ties at the k-th score may go either way).
    """
    import torch

    got, ref_scores = got.cpu().long(), ref_scores.cpu().double()
    bad = 0
    for row in range(ref_scores.shape[0]):
        scores = ref_scores[row]
        visible = int(torch.isfinite(scores).sum())
        want = min(k, visible)
        chosen = got[row][got[row] >= 0]
        if int((got[row] == -1).sum()) != k - want or len(set(chosen.tolist())) != want:
            bad += 1
            continue
        if want == 0:
            continue
        if (chosen >= scores.shape[0]).any() or not torch.isfinite(scores[chosen]).all():
            bad += 1
            continue
        if bool((scores[chosen] < _kth(scores, want) - _slack(scores, tie_tol)).any()):
            bad += 1
    return bad


def set_disagreement_rows(got, other, ref_scores, k: int, tie_tol: float) -> int:
    """Rows where two selections (int [N, k], -1 = none) hold different sets, except when every
    differing entry ties the k-th score of ``ref_scores`` (float64 [N, S]; slack as in
    ``topk_mismatch_rows``)."""
    import torch

    got, other, ref_scores = got.cpu().long(), other.cpu().long(), ref_scores.cpu().double()
    bad = 0
    for row in range(got.shape[0]):
        a, b = set(got[row].tolist()) - {-1}, set(other[row].tolist()) - {-1}
        if a == b:
            continue
        scores = ref_scores[row]
        differing = torch.tensor(sorted(a ^ b))
        if len(a) != len(b) or (differing >= scores.shape[0]).any():
            bad += 1
            continue
        want = min(k, int(torch.isfinite(scores).sum()))
        if bool(((scores[differing] - _kth(scores, want)).abs() > _slack(scores, tie_tol)).any()):
            bad += 1
    return bad


def _kth(scores, k: int) -> float:
    return float(scores.topk(k).values[-1])


def _slack(scores, tie_tol: float) -> float:
    import torch

    return tie_tol * float(scores[torch.isfinite(scores)].abs().max())


# ---------------------------------------------------------------- checks


@dataclass
class Context:
    """What every check gets: shapes, spec, device, tolerances (gate key -> value), whether the
    target computes in fp8 (MoE fp8 path checked too), the model's semantic operator names."""

    spec: ModelSpec
    shapes: Shapes
    device: str
    tolerances: dict[str, float]
    fp8_compute: bool
    op_names: tuple[str, ...] = ()

    def tol(self, path: str) -> float:
        return float(self.tolerances[GATE_KEYS[path]])

    def gen(self, offset: int = 0):
        import torch

        return torch.Generator().manual_seed(SEED + offset)


def _randn(ctx: Context, *shape, gen, scale: float = 1.0):
    import torch

    return (torch.randn(*shape, generator=gen) * scale).to(ctx.device)


def _dsa_cache(ctx: Context, latent_format: str, gen):
    """A one-layer PagedKVCache (MLA + DSA layout) with the check's sequences written in one prefill step.

    Returns (cache, batch, latent fp32 [N, rank], index keys float64 [N, index_dim]); one spare
    page per sequence is left for decode steps."""
    from adapt.kernels.formats import PAGE_SIZE
    from adapt.runtime.kv_cache import PagedKVCache, mla_layout

    s = ctx.shapes
    layout = mla_layout(s.mla_rank, s.mla_rope, s.index_dim, latent_format=latent_format,
                        latent_scale_group=max(16, s.mla_rank // 4))
    cache = PagedKVCache(sum(-(-n // PAGE_SIZE) + 1 for n in s.lengths), {0: layout}, ctx.device)
    batch = cache.append_tokens([cache.add_sequence() for _ in s.lengths], list(s.lengths))
    latent, keys = _write_tokens(ctx, cache, batch, gen)
    return cache, batch, latent, keys


def _write_tokens(ctx: Context, cache, batch, gen):
    """Random latent, rope and indexer keys (through quantize_fp8_rows, Triton) at the batch's slots.

    Returns (latent fp32 [N, rank], index keys float64 [N, index_dim])."""
    import torch

    from adapt.kernels import dsa

    s, n = ctx.shapes, batch.num_tokens
    latent = _randn(ctx, n, s.mla_rank, gen=gen)
    keys = torch.randn(n, s.index_dim, generator=gen, dtype=torch.float64)
    k8, kscale = dsa.quantize_fp8_rows(keys.float().to(ctx.device))
    cache.dsa_layer(0).write(batch.slots, latent, _randn(ctx, n, s.mla_rope, gen=gen), k8, kscale)
    return latent, keys


def check_dsa_indexer(ctx: Context, op: str) -> list[CheckResult]:
    """index_scores (Triton, e4m3 operands) and index_topk against twins and float64, for the
    prefill rows (64-row query tiles) and one decode step (one row per sequence). Top-k ties are
    judged with the score tolerance: scores that close to the k-th may go either way."""
    import torch

    from adapt.kernels import dsa
    from adapt.kernels.reference import index_scores_reference

    s = ctx.shapes
    # The interpreter multiplies the e4m3 operands in fp32; a GPU's fp8 MMA accumulates with less.
    path = "fp8_mma" if ctx.device == "cuda" else "fp32"
    gen = ctx.gen(1)
    cache, batch, _, _ = _dsa_cache(ctx, "bf16", gen)
    decode = cache.append_tokens(list(range(len(s.lengths))), [1] * len(s.lengths))
    _write_tokens(ctx, cache, decode, gen)
    layer = cache.dsa_layer(0)
    results = []
    for phase, step in (("prefill", batch), ("decode", decode)):
        n = step.num_tokens
        q8, q_scale = dsa.quantize_fp8_rows(_randn(ctx, n, s.index_heads, s.index_dim, gen=gen))
        weights = dsa.fold_index_weights(_randn(ctx, n, s.index_heads, gen=gen), q_scale, s.index_dim)
        limits = (step.positions + 1).int()
        cols = -(-(max(s.lengths) + 1) // dsa.KEY_BLOCK) * dsa.KEY_BLOCK
        args = (q8, weights, layer.index_k, layer.index_scale, step.block_table, step.token_seq, limits)
        got = dsa.index_scores(*args, cols)
        twin = dsa.index_scores_torch(*args, cols)
        ref = index_scores_reference(q8, weights, layer.index_k, layer.index_scale, step.block_table,
                                     step.token_seq, limits, cols)
        visible = torch.isfinite(ref)
        same_mask = bool(torch.equal(torch.isfinite(got.cpu()), visible))
        results.append(CheckResult(op, "adapt.kernels.dsa.index_scores",
                                   f"indexer scores ({phase}, {n} rows)", path,
                                   rel_error(got, twin, visible), rel_error(got, ref, visible),
                                   ctx.tol(path), finite=same_mask and not bool(torch.isnan(got).any()),
                                   detail="" if same_mask else "-inf entries differ from the causal limits"))
        k = s.index_topk
        idx, _ = dsa.index_topk(*args, k)
        idx_twin, _ = dsa.index_topk_torch(*args, k)
        tie = ctx.tol(path)
        results.append(CheckResult(op, "adapt.kernels.dsa.index_topk", f"top-{k} sets ({phase}, {n} rows)",
                                   "topk", set_disagreement_rows(idx, idx_twin, ref, k, tie),
                                   topk_mismatch_rows(idx, ref, k, tie), ctx.tol("topk")))
    return results


def check_sparse_mla(ctx: Context, op: str) -> list[CheckResult]:
    """sparse_mla over the indexer's selection, bf16 and fp8 latent caches, vs twin and float64."""
    import torch

    from adapt.kernels import sparse_mla

    s = ctx.shapes
    results = []
    for offset, latent_format in enumerate(("bf16", "fp8")):
        gen = ctx.gen(10 + offset)
        cache, batch, latent, _ = _dsa_cache(ctx, latent_format, gen)
        layer = cache.dsa_layer(0)
        n = batch.num_tokens
        rows = []
        for pos in batch.positions.tolist():
            chosen = torch.randperm(pos + 1, generator=gen)[: s.index_topk]
            padded = torch.cat([chosen, torch.full((s.index_topk - len(chosen),), -1)])
            rows.append(padded[torch.randperm(s.index_topk, generator=gen)])
        # A spread of query rows (each sequence's first and last included) keeps the interpreter quick.
        picked = torch.linspace(0, n - 1, MLA_QUERY_ROWS).round().long().unique()
        starts = batch.query_starts[1:-1].cpu()
        picked = torch.cat([picked, starts, starts - 1]).unique()
        indices = torch.stack(rows)[picked].int().to(ctx.device)
        q_nope = _randn(ctx, len(picked), s.mla_heads, s.mla_rank, gen=gen).bfloat16()
        q_rope = _randn(ctx, len(picked), s.mla_heads, s.mla_rope, gen=gen).bfloat16()
        token_seq = batch.token_seq[picked.to(ctx.device)]
        args = (q_nope, q_rope, layer.latent_nope, layer.latent_scale, layer.latent_rope, batch.block_table,
                token_seq, indices, s.mla_scale)
        got = sparse_mla.sparse_mla(*args)
        twin = sparse_mla.sparse_mla_torch(*args, out_dtype=torch.float32)
        ref = _mla_reference(layer, batch, token_seq, indices, q_nope, q_rope, s.mla_scale, None)
        results.append(CheckResult(op, "adapt.kernels.sparse_mla.sparse_mla",
                                   f"attention over top-{s.index_topk}, {latent_format} latent cache", "bf16",
                                   twin_error(got, twin, float(ctx.tolerances[TWIN_KEYS["cpu"]])),
                                   rel_error(got, ref), ctx.tol("bf16"),
                                   finite=bool(torch.isfinite(got).all())))
        if latent_format == "fp8":
            exact = _mla_reference(layer, batch, token_seq, indices, q_nope, q_rope, s.mla_scale, latent)
            results.append(CheckResult(op, "adapt.kernels.sparse_mla.sparse_mla",
                                       "fp8 latent cache vs unquantized latent (float64)", "fp8",
                                       None, rel_error(got, exact), ctx.tol("fp8"),
                                       finite=bool(torch.isfinite(got).all())))
    return results


def _mla_reference(layer, batch, token_seq, indices, q_nope, q_rope, scale, latent):
    """``sparse_mla_reference`` over the layer's dequantized cache rows; with ``latent`` (fp32 [N, rank]
    in slot order of ``batch``) the nope part of the batch's rows is the unquantized latent."""
    import torch

    from adapt.kernels.reference import sparse_mla_reference

    rank = q_nope.shape[-1]
    kv = layer.latent_rows(torch.arange(layer.latent_nope.shape[0] * 64, device=q_nope.device)).double().cpu()
    if latent is not None:
        kv[batch.slots.cpu(), :rank] = latent.double().cpu()
    return sparse_mla_reference(q_nope, q_rope, kv, batch.block_table, token_seq, indices, scale)


def check_indexer_cache(ctx: Context, op: str) -> list[CheckResult]:
    """Indexer keys through quantize_fp8_rows (Triton) into the paged cache and back, vs the twin
    quantizer's round trip and the float64 keys."""
    import torch

    from adapt.kernels import dsa

    gen = ctx.gen(20)
    cache, batch, _, keys = _dsa_cache(ctx, "bf16", gen)
    got = cache.dsa_layer(0).index_key_rows(batch.slots)
    k8, kscale = dsa.quantize_fp8_rows_torch(keys.float().to(ctx.device))
    twin = k8.float() * kscale.unsqueeze(-1)
    return [CheckResult(op, "adapt.runtime.kv_cache.PagedKVCache", "indexer key e4m3 round trip", "fp8",
                        rel_error(got, twin), rel_error(got, keys), ctx.tol("fp8"),
                        finite=bool(torch.isfinite(got).all()))]


def _router_config(ctx: Context):
    from adapt.kernels.routing import RouterConfig

    ffn = _first_moe(ctx.spec).ffn
    s = ctx.shapes
    return RouterConfig(top_k=s.top_k, scoring=ffn.scoring, n_group=s.n_group, topk_group=s.topk_group,
                        renormalize=ffn.norm_topk_prob or ctx.spec.model_type == "gpt_oss",
                        routed_scaling=ffn.routed_scaling)


def _dense(weights, ids, experts: int):
    """[T, k] weights at ids -> float64 [T, E]."""
    import torch

    out = torch.zeros(ids.shape[0], experts, dtype=torch.float64)
    return out.scatter_(1, ids.long().cpu(), weights.double().cpu())


def _route_inputs(ctx: Context, gen):
    ffn = _first_moe(ctx.spec).ffn
    logits = _randn(ctx, ctx.shapes.tokens, ctx.shapes.experts, gen=gen)
    bias = _randn(ctx, ctx.shapes.experts, gen=gen, scale=0.1) if ffn.correction_bias else None
    return logits, bias


def check_routing(ctx: Context, op: str) -> list[CheckResult]:
    """route (Triton) vs route_torch and float64: expert sets per token and the routed weights."""
    import torch

    from adapt.kernels import reference, routing

    config = _router_config(ctx)
    logits, bias = _route_inputs(ctx, ctx.gen(30))
    w, ids = routing.route(logits, config, bias)
    w_twin, ids_twin = routing.route_torch(logits, config, bias)
    w_ref, ids_ref, choice = reference.route_reference(logits, config, bias)
    tie = ctx.tol("fp32")
    e = ctx.shapes.experts
    rule = f"{config.scoring} top-{config.top_k} of {e}" + (
        f", {config.topk_group} of {config.n_group} groups" if config.n_group > 1 else "")
    return [
        CheckResult(op, "adapt.kernels.routing.route", f"expert sets ({rule})", "topk",
                    set_disagreement_rows(ids, ids_twin, choice, config.top_k, tie),
                    topk_mismatch_rows(ids, choice, config.top_k, tie), ctx.tol("topk")),
        CheckResult(op, "adapt.kernels.routing.route", "routed weights", "fp32",
                    rel_error(_dense(w, ids, e), _dense(w_twin, ids_twin, e)),
                    rel_error(_dense(w, ids, e), _dense(w_ref, ids_ref, e)), ctx.tol("fp32"),
                    finite=bool(torch.isfinite(w).all())),
    ]


def check_permute(ctx: Context, op: str) -> list[CheckResult]:
    """permute_by_expert (Triton) vs its twin: the sorted slot order must be identical."""
    import torch

    from adapt.kernels import routing

    config = _router_config(ctx)
    logits, bias = _route_inputs(ctx, ctx.gen(40))
    _, ids = routing.route_torch(logits, config, bias)
    got = routing.permute_by_expert(ids, ctx.shapes.experts)
    twin = routing.permute_by_expert_torch(ids, ctx.shapes.experts)
    flat = ids.reshape(-1).long().cpu()
    expected = flat.sort(stable=True).values
    differs = sum(int(not torch.equal(a.cpu(), b.cpu())) for a, b in (
        (got.sorted_slot, twin.sorted_slot), (got.slot_pos, twin.slot_pos),
        (got.expert_offsets, twin.expert_offsets)))
    wrong = int(not torch.equal(flat[got.sorted_slot.long().cpu()], expected))
    return [CheckResult(op, "adapt.kernels.routing.permute_by_expert", "slot order by expert (stable)",
                        "topk", differs, wrong, ctx.tol("topk"))]


def _mxfp4_layer(ctx: Context, gen):
    """Random MoE layer (experts as in the spec's layout) quantized with quantize_mxfp4 (Triton).

    Returns (MoEWeights, w1 float64 [E, 2I, H], w2 float64 [E, H, I])."""
    import torch

    from adapt.kernels import moe_gemm, mxfp4

    s, ffn = ctx.shapes, _first_moe(ctx.spec).ffn
    w1 = torch.randn(s.experts, 2 * s.intermediate, s.hidden, generator=gen, dtype=torch.float64) * 0.1
    w2 = torch.randn(s.experts, s.hidden, s.intermediate, generator=gen, dtype=torch.float64) * 0.1
    b1 = _randn(ctx, s.experts, 2 * s.intermediate, gen=gen, scale=0.1) if ffn.bias else None
    b2 = _randn(ctx, s.experts, s.hidden, gen=gen, scale=0.1) if ffn.bias else None
    p1, s1 = mxfp4.quantize_mxfp4(w1.float().to(ctx.device))
    p2, s2 = mxfp4.quantize_mxfp4(w2.float().to(ctx.device))
    weights = moe_gemm.MoEWeights(mxfp4.to_gpt_oss_blocks(p1), s1, mxfp4.to_gpt_oss_blocks(p2), s2, b1, b2,
                                  gate_up_interleaved=ctx.spec.model_type == "gpt_oss")
    return weights, w1, w2


def check_mxfp4_codec(ctx: Context, op: str) -> list[CheckResult]:
    """quantize_mxfp4 / dequantize_mxfp4 (Triton) vs twins (bit-exact expected) and float64 values."""
    import torch

    from adapt.kernels import mxfp4, reference

    gen = ctx.gen(50)
    x = torch.randn(4 * ctx.shapes.hidden, 2 * ctx.shapes.hidden, generator=gen, dtype=torch.float64)
    packed, scales = mxfp4.quantize_mxfp4(x.float().to(ctx.device))
    p_twin, s_twin = mxfp4.quantize_mxfp4_torch(x.float().to(ctx.device))
    decoded = mxfp4.dequantize_mxfp4(packed, scales)
    twin = mxfp4.dequantize_mxfp4_torch(packed, scales)
    codes_differ = int((packed != p_twin).sum() + (scales != s_twin).sum())
    return [
        CheckResult(op, "adapt.kernels.mxfp4.dequantize_mxfp4", "E2M1 + E8M0 decode", "fp32",
                    rel_error(decoded, twin), rel_error(decoded, reference.mxfp4_decode_reference(packed, scales)),
                    ctx.tol("fp32"),
                    finite=bool(torch.isfinite(decoded).all())),
        CheckResult(op, "adapt.kernels.mxfp4.quantize_mxfp4", "encode N(0,1) weights", "mxfp4",
                    None, rel_error(decoded, x), ctx.tol("mxfp4"),
                    finite=codes_differ == 0,
                    detail="" if codes_differ == 0 else f"{codes_differ} bytes differ from the twin"),
    ]


def _stacked_layer(ctx: Context, gen, fmt: str, hidden: int, inter: int):
    """Random MoE layer stored as ``fmt`` ('fp8_block': e4m3 values with one power-of-two scale per
    128 x 128 block, DeepSeek-V3.2's ue8m0 rule, so value times scale is exact in any summation order
    and the twin's fp32 sums match the kernel's; 'bf16'), experts as in the spec's layout -> ``StackedExperts``."""
    import torch

    from adapt.kernels.fp8 import pow2_scale
    from adapt.kernels.moe_weights import StackedExperts, fp8_block_copy

    s, ffn = ctx.shapes, _first_moe(ctx.spec).ffn
    w1 = torch.randn(s.experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(s.experts, hidden, inter, generator=gen) * 0.1
    b1 = _randn(ctx, s.experts, 2 * inter, gen=gen, scale=0.1) if ffn.bias else None
    b2 = _randn(ctx, s.experts, hidden, gen=gen, scale=0.1) if ffn.bias else None
    weights = StackedExperts(w1.bfloat16().to(ctx.device), w2.bfloat16().to(ctx.device), None, None, b1, b2,
                             gate_up_interleaved=ctx.spec.model_type == "gpt_oss")
    return fp8_block_copy(weights, pow2_scale) if fmt == "fp8_block" else weights


def moe_format(op: str) -> str:
    """The expert format of a grouped-GEMM operator: 'fp8_block', 'bf16' or 'mxfp4'."""
    return next((f for f in ("fp8_block", "bf16") if op.endswith(f)), "mxfp4")


def check_mxfp4_moe(ctx: Context, op: str) -> list[CheckResult]:
    """moe_forward (routing, permutation, grouped GEMMs, combine) vs moe_forward_torch and a float64
    layer on the weights decoded from their format's definition (``reference.moe_reference``), in the
    expert format of ``op``: MXFP4 (bf16 path, and the fp8 path on fp8 targets), FP8 with 128 x 128
    block scales (bf16 activations, and e4m3 activations per 1x128 group on fp8 targets; widths of at
    least 256 x 128 so several blocks and both gate and up blocks are read) or bf16."""
    import torch

    from adapt.kernels import moe_gemm, reference, routing

    s, ffn = ctx.shapes, _first_moe(ctx.spec).ffn
    gen = ctx.gen(60)
    fmt = moe_format(op)
    hidden_size = s.hidden
    if fmt == "mxfp4":
        weights, _, _ = _mxfp4_layer(ctx, gen)
    else:
        hidden_size = max(s.hidden, 256) if fmt == "fp8_block" else s.hidden
        weights = _stacked_layer(ctx, gen, fmt, hidden_size, max(s.intermediate, 128) if fmt == "fp8_block"
                                 else s.intermediate)
    hidden = _randn(ctx, s.tokens, hidden_size, gen=gen).bfloat16()
    gate = _randn(ctx, s.experts, hidden_size, gen=gen, scale=hidden_size ** -0.5)
    bias = _randn(ctx, s.experts, gen=gen, scale=0.1) if ffn.correction_bias else None
    config = _router_config(ctx)
    activation = ffn.activation
    limit = ffn.swiglu_limit or 7.0
    kw = dict(correction_bias=bias, activation=activation, limit=limit)
    if fmt == "fp8_block":
        kw["act_quant"] = "group128"
    ref = reference.moe_reference(hidden, routing.gate_logits(hidden, gate), weights, config, bias, activation, limit)
    results = []
    computes = ("bf16", "fp8") if ctx.fp8_compute and fmt != "bf16" else ("bf16",)
    for compute in computes:
        got = moe_gemm.moe_forward(hidden, gate, weights, config, compute=compute, **kw)
        twin = moe_gemm.moe_forward_torch(hidden, gate, weights, config, compute=compute, **kw)
        results.append(CheckResult(
            op, "adapt.kernels.moe_gemm.moe_forward",
            f"MoE layer, {fmt} experts, {s.experts} experts top-{config.top_k}, {activation}, {compute} compute",
            compute, rel_error(got, twin), rel_error(got, ref), ctx.tol(compute),
            finite=bool(torch.isfinite(got).all())))
    return results


CHECKS: dict[str, Callable[[Context, str], list[CheckResult]]] = {
    "adapt.kernels.dsa.index_topk": check_dsa_indexer,
    "adapt.kernels.sparse_mla.sparse_mla": check_sparse_mla,
    "adapt.runtime.kv_cache.PagedKVCache": check_indexer_cache,
    "adapt.kernels.moe_gemm.moe_forward": check_mxfp4_moe,
    "adapt.kernels.mxfp4.dequantize_mxfp4": check_mxfp4_codec,
    "adapt.kernels.routing.route": check_routing,
    "adapt.kernels.routing.permute_by_expert": check_permute,
}
# A whole-layer kernel also runs the checks of the kernels inside it.
PARTS = {"adapt.kernels.moe_gemm.moe_forward": ("adapt.kernels.routing.route",
                                                "adapt.kernels.routing.permute_by_expert",
                                                "adapt.kernels.mxfp4.dequantize_mxfp4")}


# ---------------------------------------------------------------- native ops on the target's device


def target_device(target) -> tuple[str | None, str]:
    """(torch device, description) when this machine has the target's device, else (None, why not).

    ``cpu`` targets run here; an NVIDIA target needs a visible GPU of its compute capability; an
    AMD target a ROCm GPU of its gfx architecture.
    """
    import torch

    cc = target.compute_capability
    if cc == "cpu":
        return "cpu", "this machine's CPU"
    if not torch.cuda.is_available():
        return None, f"no GPU is visible here (torch.cuda.is_available() is False); the target is {target.name} ({cc})"
    props = torch.cuda.get_device_properties(0)
    here = getattr(props, "gcnArchName", "") if torch.version.hip else f"{props.major}.{props.minor}"
    if here.split(":")[0] != cc:
        return None, f"the visible GPU is {props.name} ({here}), the target {target.name} is {cc}"
    return "cuda", f"{props.name} ({here})"


def _native_check(op: str, device: str, tolerances: dict[str, float]) -> CheckResult | None:
    """One native operator computed by torch on ``device`` (the stack's op as torch runs it there)
    against float64 on the CPU; None for an operator family adapt has no torch check for."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(SEED + 99)
    x64 = torch.randn(16, 128, generator=gen, dtype=torch.float64)
    w64 = torch.randn(96, 128, generator=gen, dtype=torch.float64) / 128 ** 0.5
    bf = lambda t: t.to(device=device, dtype=torch.bfloat16)  # noqa: E731
    tol = lambda path: float(tolerances[GATE_KEYS[path]])  # noqa: E731

    def result(kernel, check, path, got, ref):
        got = got.detach().double().cpu()
        return CheckResult(op, kernel, check, path, None, rel_error(got, ref), tol(path),
                           finite=bool(torch.isfinite(got).all()))

    x_in, w_in = x64.to(torch.bfloat16).double(), w64.to(torch.bfloat16).double()  # the operands as stored
    if op == "embedding":
        ids = torch.randint(0, 96, (32,), generator=gen)
        return result("torch.nn.functional.embedding", "row lookup (exact)", "fp32",
                      F.embedding(ids.to(device), bf(w64)), w_in[ids])
    if op.startswith(("linear_", "moe_grouped_gemm_", "fuse_qkv", "fuse_gate_up", "fuse_dequant")):
        return result("torch.nn.functional.linear", "bf16 matmul [16,128] x [128,96]", "bf16",
                      F.linear(bf(x64), bf(w64)), x_in @ w_in.T)
    if op in ("rmsnorm", "fuse_residual_rmsnorm"):
        scale = x_in.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        return result("torch.nn.functional.rms_norm", "bf16 RMSNorm", "bf16",
                      F.rms_norm(bf(x64), (128,), bf(w64[0]), 1e-6), x_in * scale * w_in[0])
    if op == "layernorm":
        ref = (x_in - x_in.mean(-1, keepdim=True)) / (x_in.var(-1, unbiased=False, keepdim=True) + 1e-6).sqrt()
        return result("torch.nn.functional.layer_norm", "bf16 LayerNorm", "bf16",
                      F.layer_norm(bf(x64), (128,), eps=1e-6), ref)
    if op.startswith("rope_"):
        pos = torch.arange(16, dtype=torch.float64)[:, None]
        angle = pos * 10000.0 ** (-torch.arange(0, 64, dtype=torch.float64) / 64)
        a, b = x64[:, :64], x64[:, 64:]
        ref = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)
        ang, xs = angle.float().to(device), x64.float().to(device)
        got = torch.cat([xs[:, :64] * ang.cos() - xs[:, 64:] * ang.sin(),
                         xs[:, 64:] * ang.cos() + xs[:, :64] * ang.sin()], -1)
        return result("torch.cos/sin rotation", "fp32 rotary embedding (neox halves)", "fp32", got, ref)
    if op.startswith(("swiglu", "fuse_mask_softmax")):
        if op.startswith("swiglu"):
            g, u = x_in[:, :64], x_in[:, 64:]
            return result("torch.nn.functional.silu", "bf16 silu(gate) * up", "bf16",
                          F.silu(bf(x64)[:, :64]) * bf(x64)[:, 64:], g / (1 + (-g).exp()) * u)
        return result("torch.softmax", "bf16 masked softmax", "bf16", torch.softmax(bf(x64), -1),
                      torch.softmax(x_in, -1))
    if op.startswith("attention_"):
        q = torch.randn(1, 4, 16, 64, generator=gen, dtype=torch.float64)
        k = torch.randn(1, 4, 16, 64, generator=gen, dtype=torch.float64)
        v = torch.randn(1, 4, 16, 64, generator=gen, dtype=torch.float64)
        q_, k_, v_ = (t.to(torch.bfloat16).double() for t in (q, k, v))
        mask = torch.ones(16, 16, dtype=torch.bool).tril()
        ref = torch.softmax((q_ @ k_.transpose(-1, -2) / 8).masked_fill(~mask, float("-inf")), -1) @ v_
        return result("torch.nn.functional.scaled_dot_product_attention", "bf16 causal attention, 4 heads x 64",
                      "bf16", F.scaled_dot_product_attention(bf(q), bf(k), bf(v), is_causal=True), ref)
    if op.startswith("routing_") or op in ("moe_permute", "fuse_routing_permute"):
        logits = torch.randn(32, 16, generator=gen, dtype=torch.float32)
        got = torch.topk(logits.to(device), 4, dim=-1).indices.sort(-1).values.cpu()
        ref = torch.topk(logits.double(), 4, dim=-1).indices.sort(-1).values
        mismatched = int((got != ref).any(-1).sum())
        return CheckResult(op, "torch.topk", "top-4 of 16 expert sets, 32 tokens", "topk", None, mismatched,
                           tol("topk"))
    if op.startswith("kv_cache_"):
        cache = torch.zeros(4 * 16, 128, device=device, dtype=torch.bfloat16)
        slots = torch.randperm(64, generator=gen)[:16]
        cache.index_copy_(0, slots.to(device), bf(x64))
        return result("torch.Tensor.index_copy_", "paged write and gather back (exact)", "fp32",
                      cache[slots.to(device)], x_in)
    return None


def check_native_ops(rows: list[GapRow], target, tolerances: dict[str, float]) -> tuple[list[CheckResult], str]:
    """Check each native operator through torch on the target's device against float64.

    Returns (results, where): ``where`` names the device the checks ran on, or why none ran
    (results empty). Operators with no torch check here are not counted as checked."""
    device, where = target_device(target)
    if device is None or not rows:
        return [], where
    found = [_native_check(r.op.name, device, tolerances) for r in rows]
    return [f for f in found if f is not None], where


# ---------------------------------------------------------------- the stage


@dataclass
class Need:
    """An operator that needs a check: its classification and the adapt kernel that provides it."""

    row: GapRow
    kernel: str


def needed_kernels(spec: ModelSpec, rows: list[GapRow]) -> tuple[list[Need], list[GapRow]]:
    """Split classified operators into (those needing a kernel check, the others)."""
    needs, others = [], []
    for row in rows:
        if row.status == "adapt_kernel":
            needs.append(Need(row, row.kernel))
        elif row.status == "missing" and row.stack_status in ("missing", "absent") \
                and row.op.name in ADAPT_KERNEL_FOR_OP:
            needs.append(Need(row, ADAPT_KERNEL_FOR_OP[row.op.name]))
        else:
            others.append(row)
    return needs, others


def run_kernel_tests(model: str, target: str, stack: str | None = None, gates: dict | None = None,
                     device: str | None = None) -> StageReport:
    """Stage 3 as a gated report (stage "kernels", number 3).

    model: preset, config.json or model directory; target: name or YAML; stack: stack name or
    YAML (default: the target's default_stack); gates: the full gates dict (default gates.yaml);
    device: "cpu" or "cuda" (default: cuda when available, else cpu under the Triton interpreter).
    """
    import torch

    started = now_iso()
    clock = time.perf_counter()
    gates = gates if gates is not None else load_gates()
    thresholds = {**load_gates()["kernels"], **gates.get("kernels", {})}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise InputError(f"cannot run kernel checks on device {device!r}", field="device",
                         hint="use 'cpu' (Triton interpreter) or 'cuda' on a machine with a GPU")
    if device == "cpu" and torch.cuda.is_available():
        raise InputError("with a GPU present the Triton kernels run on it", field="device", hint="use 'cuda'")
    # Before anything imports triton (classifying adapt_kernel entries imports the kernel modules).
    interpreting = device == "cpu" and interpreter_state() == "interpreter"
    spec = load_spec(model)
    tgt = load_target(target)
    table = load_stack(stack or tgt.default_stack)
    report = StageReport(stage="kernels", number=3, title=TITLE, started=started)

    ops, _ = ops_from_spec(spec)
    needs, others = needed_kernels(spec, [classify(op, table, tgt) for op in ops])
    if device == "cpu" and needs and not interpreting:
        return run_in_interpreter_process("adapt.stages.kernels",
                                          {"model": model, "target": target, "stack": stack, "gates": gates},
                                          stage="kernels", number=3, title=TITLE, timeout_s=CHILD_TIMEOUT_S)
    for row in others:
        if row.status in ("native", "composable"):
            continue
        report.add("info", "kernels.not_checked",
                   f"{row.op.name}: {row.status} on {tgt.name}, no adapt kernel to check ({row.provided})")
    native = [r.op.name for r in others if r.status == "native"]
    composable = [r.op.name for r in others if r.status == "composable"]
    if native:
        report.add("info", "kernels.native", f"not needed: native in {table.name}: {', '.join(native)}")
    if composable:
        report.add("info", "kernels.composable",
                   f"not needed: composable in {table.name} from native operators: {', '.join(composable)}")

    interpreter = device == "cpu" and bool(needs)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    results: list[CheckResult] = []
    if needs:
        ctx = Context(spec, scaled_shapes(spec), device, thresholds, fp8_compute=tgt.supports_dtype("fp8"),
                      op_names=tuple(op.name for op in ops))
        results = _run_checks(ctx, needs, report)

    rows_table = [r.row() for r in results]
    if rows_table:
        report.tables["kernel checks"] = rows_table
    for r in results:
        if not r.passed:
            what = "non-finite output" if not r.finite and not r.detail else (r.detail or "")
            errors = ", ".join(f"{name} {value:.3g} {'>' if value > tol else '<='} {tol:g}"
                               for name, value, tol in r.limits())
            report.add("error", "kernels.tolerance",
                       f"{r.op}: {r.kernel} ({r.check}) fails: {errors}" + (f"; {what}" if what else ""),
                       "run the kernel's own tests (pytest tests/kernels) and compare with its torch twin")
    native_results, native_reason = check_native_ops(
        [r for r in others if r.status == "native"], tgt, thresholds)
    if native_results:
        report.tables["native op checks"] = [r.row() for r in native_results]
    for r in native_results:
        if not r.passed:
            report.add("error", "kernels.native_tolerance",
                       f"{r.op}: {r.kernel} on {native_reason} ({r.check}) fails: "
                       + ", ".join(f"{name} {value:.3g} vs {tol:g}" for name, value, tol in r.limits()),
                       f"the {table.name} stack's torch op disagrees with float64 on this device")
    unchecked = sorted(set(native) - {r.op for r in native_results})
    if native_results and unchecked:
        report.add("info", "kernels.native_unchecked",
                   f"native op(s) with no torch check in adapt: {', '.join(unchecked)}")
    if native and not native_results:
        report.add("warn", "kernels.native_not_run",
                   f"not run here: {len(native)} native op(s) of {table.name} ({', '.join(native)}): {native_reason}",
                   f"run stage 3 on a {tgt.name} machine to check them on the device")
    if not results and not native_results:
        report.not_measured(f"stage 3 ran no check here ({len(native)} native op(s) not run here: {native_reason})"
                            if native else "stage 3 ran no check here; it does not pass with zero checks",
                            f"run stage 3 on a {tgt.name} machine (the target's device runs the native ops)"
                            if native else f"check {table.name}'s stack table: it names no operator to check")
    if interpreter:
        report.add("info", "kernels.interpreter",
                   "no CUDA device: the Triton kernels ran under the Triton interpreter (TRITON_INTERPRET=1) "
                   "on CPU; GPU code generation was not exercised")
    if not needs:
        report.add("info", "kernels.none_needed",
                   f"{model} needs no adapt kernel on {tgt.name} "
                   f"with stack {table.name}")
    failed = [r for r in results + native_results if not r.passed]
    by_path: dict[str, float] = {}
    for r in results:
        if r.dtype_path == "topk":
            continue
        worst = max((e for e in (r.twin_error, r.ref_error) if e is not None), default=0.0)
        by_path[r.dtype_path] = max(by_path.get(r.dtype_path, 0.0), worst)
    report.metrics = {
        "ops_needing_checks": len(needs), "ops_native": len(native), "ops_composable": len(composable),
        "checks_run": len(results) + len(native_results), "checks_failed": len(failed),
        "native_checks_run": len(native_results),
        "native_not_run": len(native) if not native_results else 0,
        "max_rel_error_by_path": by_path, "seconds": round(time.perf_counter() - clock, 2),
        "triton_interpreter": interpreter,
    }
    checked = sorted({n.row.op.name for n in needs})
    report.summary = (f"{len(results)} check(s) of {len(checked)} operator(s) needing adapt kernels "
                      f"({', '.join(checked)}) on {device_name}." if needs else
                      f"No operator needs an adapt kernel on {tgt.name} with stack {table.name}.")
    report.summary += (f" {len(native_results)} native op check(s) through torch on {native_reason}."
                       if native_results else f" Native ops not checked here: {native_reason}." if native else "")
    report.summary += f" {len(failed)} failed."
    report.fingerprint = fingerprint(spec_hash=spec.spec_hash(), model=model, target=tgt.name,
                                     stack=table.name, device=device_name if needs else None,
                                     interpreter=interpreter, seed=SEED,
                                     shapes=vars(scaled_shapes(spec)), gates=thresholds)
    report.finished = now_iso()
    report.decide()
    return report


def _run_checks(ctx: Context, needs: list[Need], report: StageReport) -> list[CheckResult]:
    """Each needed kernel's checks once (whole-layer kernels bring their parts); a check that
    raises is a failed check, reported with the exception."""
    results: list[CheckResult] = []
    done: set[str] = set()
    for need in needs:
        parts = PARTS.get(need.kernel, ())
        if moe_format(need.row.op.name) != "mxfp4":  # no MXFP4 codec inside FP8-block / bf16 expert layers
            parts = tuple(p for p in parts if p != "adapt.kernels.mxfp4.dequantize_mxfp4")
        for kernel in (need.kernel, *parts):
            if kernel in done:
                continue
            done.add(kernel)
            check = CHECKS.get(kernel)
            if check is None:
                report.add("error", "kernels.no_check",
                           f"{need.row.op.name}: adapt kernel {kernel} has no tolerance check in stage 3",
                           "add a check to CHECKS in adapt/stages/kernels.py, or change the stack entry")
                continue
            part = kernel != need.kernel
            op = _part_op(ctx, kernel, need.row.op.name) if part else need.row.op.name
            try:
                found = check(ctx, op)
            except Exception as exc:  # a kernel that crashes fails its gate with the reason
                report.add("error", "kernels.crashed", f"{op}: {kernel} raised {type(exc).__name__}: {exc}",
                           "run the kernel's own tests (pytest tests/kernels)")
                continue
            for result in found:
                if part:
                    result.check += f" (inside {need.kernel.rsplit('.', 1)[-1]})"
                if result.dtype_path != "topk":
                    result.twin_tolerance = float(ctx.tolerances[TWIN_KEYS[ctx.device]])
            results.extend(found)
    return results


def _part_op(ctx: Context, kernel: str, parent_op: str) -> str:
    """The model's semantic operator that a part of a whole-layer kernel stands for."""
    if kernel == "adapt.kernels.routing.route":
        return next((name for name in ctx.op_names if name.startswith("routing_")), "routing")
    if kernel == "adapt.kernels.routing.permute_by_expert":
        return "moe_permute"
    if kernel == "adapt.kernels.mxfp4.dequantize_mxfp4":
        return "mxfp4_decode"
    return parent_op


if __name__ == "__main__":
    _child_main()
