"""Stage 4: choose how to split a model over the devices (TP x EP x PP x DP), rank the plans.

Every layout of the device count is enumerated (tensor parallel x pipeline parallel x data
parallel, with and without expert parallelism), then

1. rejected when vLLM cannot run it: head, KV-head, expert, FFN-width (and fp8 block) and layer
   divisibility (``adapt.plan.layout.layout_problems``);
2. rejected when stage 2's memory model says it does not hold ``batch`` sequences of ``context``
   tokens on every device;
3. rejected when its tensor- or expert-parallel group, or its pipeline, spans nodes although a
   layout that keeps them inside one node fits (cross-node links are an order of magnitude
   slower than NVLink);
4. costed from the target: per decode step and per prefill chunk, the time to read weights and
   KV from HBM, the matrix-unit time, TP all-reduce and EP all-gather/reduce-scatter volumes over
   the link that carries them (NVLink inside a node, the network across nodes), and PP hand-offs.

Plans are ranked by decode step time, then prefill chunk time. The best plan becomes vLLM engine
arguments, a ``vllm serve`` command and, for several nodes, the Ray bring-up steps.

The cost model is a roofline estimate, not a measurement: times are lower bounds that ignore
kernel efficiency and overlap; they rank plans, they do not predict latency.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapt.model.spec import ModelSpec
from adapt.plan.layout import (
    VLLM_GPU_MEMORY_UTILIZATION,
    GiB,
    Layout,
    MemoryPlan,
    checkpoint_component_bytes,
    devices_per_node,
    divisors,
    kv_copies,
    layout_problems,
    load_model,
    plan_memory,
    vllm_batch_defaults,
)
from adapt.report import StageReport, fingerprint, now_iso
from adapt.targets.target import Target

# When no plan fits at vLLM's default utilization and the user did not set one, plans that fit
# up to this utilization are offered with a warning (the vLLM GPT-OSS recipe runs gpt-oss-120b on
# one H100 with --gpu-memory-utilization 0.95).
MAX_RAISED_UTILIZATION = 0.95
# Contexts from which decode context parallelism is enumerated (tokens): below it the KV copies
# it removes are small next to the weights (a planning choice, not a vLLM rule).
LONG_CONTEXT_TOKENS = 32 * 1024


@dataclass
class PlanCost:
    """Roofline estimate of one plan (seconds, bytes per device).

    decode_step_s: time for one decode step of every sequence of a replica
    prefill_chunk_s: time for one prefill chunk of ``max_num_batched_tokens`` tokens
    decode_tokens_per_s: output tokens per second over all replicas at the requested batch
    *_read_bytes: HBM bytes read per device per decode step
    tp_allreduce_bytes / ep_dispatch_bytes / pp_transfer_bytes: bytes each device sends per
        decode step for that collective; *_link: "intra-node" | "inter-node" | "" (none)
    """

    decode_step_s: float
    prefill_chunk_s: float
    decode_tokens_per_s: float
    weight_read_bytes: float
    kv_read_bytes: float
    decode_compute_s: float
    decode_memory_s: float
    decode_comm_s: float
    tp_allreduce_bytes: float
    tp_link: str
    ep_dispatch_bytes: float
    ep_link: str
    pp_transfer_bytes: float
    pp_link: str


@dataclass
class ParallelPlan:
    """One layout: feasible (with its memory plan and cost) or rejected (with the reason)."""

    layout: Layout
    feasible: bool
    reason: str = ""
    memory: MemoryPlan | None = None
    cost: PlanCost | None = None
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION

    @property
    def label(self) -> str:
        return self.layout.label()

    def row(self) -> dict[str, Any]:
        """One table row: costs and memory for a feasible plan, the reason for a rejected one."""
        if self.cost is None or self.memory is None:
            return {"plan": self.label, "reason": self.reason}
        return {
            "plan": self.label,
            "decode ms": round(self.cost.decode_step_s * 1e3, 3),
            "prefill ms": round(self.cost.prefill_chunk_s * 1e3, 2),
            "tokens/s": round(self.cost.decode_tokens_per_s, 1),
            "weights GiB": round(self.memory.terms["weights"] / GiB, 2),
            "KV GiB": round(self.memory.kv_pool_bytes / GiB, 2),
            "seqs": self.memory.concurrent_sequences,
            "util": self.gpu_memory_utilization,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "layout": {**asdict(self.layout), "ep": self.layout.ep},
            "feasible": self.feasible,
            "reason": self.reason,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "cost": asdict(self.cost) if self.cost else None,
            "memory": {
                "verdict": self.memory.verdict,
                "terms": self.memory.terms,
                "kv_pool_bytes": self.memory.kv_pool_bytes,
                "concurrent_sequences": self.memory.concurrent_sequences,
            }
            if self.memory
            else None,
        }


@dataclass
class ParallelResult:
    """Ranked feasible plans (best first), rejected plans with reasons, and the best plan's
    vLLM engine arguments (keys exactly: tensor_parallel_size, pipeline_parallel_size,
    data_parallel_size, enable_expert_parallel, max_model_len, gpu_memory_utilization,
    kv_cache_dtype, block_size, max_num_batched_tokens, max_num_seqs; {} when none fits)."""

    model: str
    target: str
    devices: int
    nodes: int
    context: int
    batch: int
    feasible: list[ParallelPlan]
    rejected: list[ParallelPlan]
    engine_args: dict[str, Any]
    single_node_fits: bool
    raised_utilization: bool
    explanation: list[str] = field(default_factory=list)

    @property
    def best(self) -> ParallelPlan | None:
        return self.feasible[0] if self.feasible else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "target": self.target,
            "devices": self.devices,
            "nodes": self.nodes,
            "context": self.context,
            "batch": self.batch,
            "engine_args": self.engine_args,
            "single_node_fits": self.single_node_fits,
            "raised_utilization": self.raised_utilization,
            "feasible": [p.to_dict() for p in self.feasible],
            "rejected": [p.to_dict() for p in self.rejected],
            "explanation": self.explanation,
        }


def enumerate_layouts(spec: ModelSpec, devices: int, context: int = 0) -> list[Layout]:
    """Every TP x PP x DP split of ``devices``, with and without EP (EP only for MoE models and
    when more than one rank would share the experts); for contexts of LONG_CONTEXT_TOKENS or
    more, also every decode-context-parallel size that divides the TP ranks holding copies of
    the same KV entries."""
    out = []
    for tp in divisors(devices):
        copies = kv_copies(spec, tp)
        dcps = [d for d in divisors(copies) if d > 1] if context >= LONG_CONTEXT_TOKENS else []
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            eps = [False, True] if spec.moe_layers and tp * dp > 1 else [False]
            for ep in eps:
                out.append(Layout(tp=tp, pp=pp, dp=dp, expert_parallel=ep))
                out += [Layout(tp=tp, pp=pp, dp=dp, expert_parallel=ep, dcp=d) for d in dcps]
    return out


def crosses_nodes(layout: Layout, per_node: int, nodes: int) -> list[str]:
    """Which of the layout's groups span nodes, with vLLM's rank order (TP innermost, then PP, then DP)."""
    out = []
    if layout.tp > per_node:
        out.append("tensor parallel")
    if layout.pp > 1 and layout.tp * layout.pp > per_node:
        out.append("pipeline")
    if layout.expert_parallel and nodes > 1 and (layout.dp > 1 or layout.tp > per_node):
        out.append("expert parallel")
    return out


# ---------------------------------------------------------------------------------------
# Cost model


def _collective_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce (or all-gather + reduce-scatter) of ``nbytes`` over ``ranks``: latency plus
    2 (n - 1) / n of the bytes over the per-device link bandwidth."""
    if ranks <= 1:
        return 0.0
    return latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def _attention_flops_and_reads(
    spec: ModelSpec, layout: Layout, kv_dtype: str, tokens: int, attended: int
) -> tuple[float, float]:
    """(FLOPs for ``tokens`` query tokens, KV bytes one sequence reads) per device, each query
    attending to ``attended`` earlier tokens (sliding layers: their window; DSA: the indexer
    scores all of them, attention reads its top-k)."""
    flops = 0.0
    reads = 0.0
    tp = layout.tp
    for layer in spec.layers:
        a = layer.attention
        heads = a.num_heads // tp
        span = min(attended, a.window) if a.window else attended
        if a.kind in ("mla", "mla+dsa"):
            if a.kind == "mla+dsa":
                flops += 2 * tokens * a.index_n_heads * a.index_head_dim * attended
                reads += (a.index_head_dim + 4) * attended
                span = min(attended, a.index_topk)
            flops += 2 * tokens * heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim) * span
            latent = (a.kv_lora_rank + a.qk_rope_head_dim) * (2 if kv_dtype == "bf16" else 1)
            reads += latent * span
        else:
            kv = max(1, a.num_kv_heads // tp)
            flops += 2 * tokens * heads * (a.head_dim + a.v_head_dim) * span
            reads += kv * (a.head_dim + a.v_head_dim) * (2 if kv_dtype == "bf16" else 1) * span
    return flops / layout.pp / layout.dcp, reads / layout.pp / layout.dcp


def _expert_hit_fraction(spec: ModelSpec, tokens: float) -> float:
    """Expected fraction of one layer's routed experts that ``tokens`` tokens reach (uniform routing)."""
    moe = spec.moe_layers
    if not moe:
        return 0.0
    f = moe[0].ffn
    return 1.0 - (1.0 - f.top_k / f.num_experts) ** tokens


def _compute_dtype(spec: ModelSpec, target: Target, weights: str) -> str:
    """Dtype the matrix units run for the routed experts (fp8 only where weights are fp8 and the
    target has fp8 units; weight-only MXFP4 and bf16 run in bf16)."""
    fp8 = weights in ("fp8", "mxfp4-online", "mxfp4-offline-fp8") or (
        weights == "as-stored" and spec.quant.format_of("routed_experts").method == "fp8_block"
    )
    return "fp8" if fp8 and target.supports_dtype("fp8") else "bf16"


def plan_cost(spec: ModelSpec, target: Target, memory: MemoryPlan, *, nodes: int, batch: int) -> PlanCost:
    """Roofline cost of one feasible plan (see module docstring)."""
    layout = memory.layout
    per_node = layout.devices // nodes
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    hidden = spec.hidden
    seqs = math.ceil(batch / dp)
    layers_per_stage = math.ceil(spec.num_layers / pp)
    moe_layers_per_stage = math.ceil(len(spec.moe_layers) / pp)
    counts = spec.param_counts()
    dtype = _compute_dtype(spec, target, memory.weights_format)
    cross = crosses_nodes(layout, per_node, nodes)

    def link(group: str) -> tuple[float, float, str]:
        if group in cross:
            return target.inter_node_bandwidth, target.inter_node_latency, "inter-node"
        return target.intra_node_bandwidth, target.intra_node_latency, "intra-node"

    experts = memory.weights_by_component.get("routed_experts", 0)
    # an embedding lookup reads only the rows of the step's tokens: leave the table out of the reads
    dense_weights = memory.terms["weights"] - experts - memory.weights_by_component.get("embeddings", 0)

    def step(tokens: int, sequences: int, attended: int) -> tuple[float, dict[str, float]]:
        moe_tokens = tokens * dp if layout.expert_parallel else tokens
        weight_read = dense_weights + experts * _expert_hit_fraction(spec, moe_tokens)
        attn_flops, kv_per_sequence = _attention_flops_and_reads(
            spec, layout, memory.kv_dtype, tokens, attended
        )
        kv_read = kv_per_sequence * sequences
        gemm_flops = 2 * tokens * counts.active / (tp * pp)
        compute = gemm_flops / target.flops(dtype) + attn_flops / target.flops("bf16")
        memory_s = (weight_read + kv_read) / target.hbm_bandwidth
        bw, lat, tp_link = link("tensor parallel")
        allreduce_bytes = tokens * hidden * 2
        tp_s = 2 * layers_per_stage * _collective_time(allreduce_bytes, tp, bw, lat)
        ep_bytes = 0.0
        ep_s = 0.0
        ep_link = ""
        if layout.expert_parallel and dp > 1:
            bw, lat, ep_link = link("expert parallel")
            ep_bytes = tokens * hidden * 2
            ep_s = moe_layers_per_stage * _collective_time(ep_bytes * dp, dp, bw, lat)
        pp_bytes = tokens * hidden * 2
        bw, lat, pp_link = link("pipeline")
        pp_s = (pp - 1) * (lat + pp_bytes / bw) if pp > 1 else 0.0
        # DCP: every layer merges the partial attention outputs of the dcp ranks (bf16 values)
        dcp_s = layers_per_stage * _collective_time(
            tokens * spec.layers[0].attention.num_heads // tp * spec.layers[0].attention.v_head_dim * 2,
            layout.dcp,
            *link("tensor parallel")[:2],
        )
        stage = max(compute, memory_s) + tp_s + ep_s + dcp_s
        total = pp * stage + pp_s
        parts = {
            "weight_read": weight_read,
            "kv_read": kv_read,
            "compute": pp * compute,
            "memory": pp * memory_s,
            "comm": pp * (tp_s + ep_s) + pp_s,
            "tp_bytes": 2 * layers_per_stage * allreduce_bytes if tp > 1 else 0,
            "ep_bytes": 2 * moe_layers_per_stage * ep_bytes * (dp - 1),
            "pp_bytes": pp_bytes if pp > 1 else 0,
            "tp_link": tp_link if tp > 1 else "",
            "ep_link": ep_link,
            "pp_link": pp_link if pp > 1 else "",
        }
        return total, parts

    decode, d = step(seqs, seqs, memory.context)
    chunk = memory.max_num_batched_tokens
    prefill, _ = step(chunk, 1, min(memory.context, chunk) // 2 + 1)
    return PlanCost(
        decode_step_s=decode,
        prefill_chunk_s=prefill,
        decode_tokens_per_s=batch / decode if decode else 0.0,
        weight_read_bytes=d["weight_read"],
        kv_read_bytes=d["kv_read"],
        decode_compute_s=d["compute"],
        decode_memory_s=d["memory"],
        decode_comm_s=d["comm"],
        tp_allreduce_bytes=d["tp_bytes"],
        tp_link=d["tp_link"],
        ep_dispatch_bytes=d["ep_bytes"],
        ep_link=d["ep_link"],
        pp_transfer_bytes=d["pp_bytes"],
        pp_link=d["pp_link"],
    )


@dataclass
class KernelCost:
    """Stage 4's roofline for one layer's kernel on one device (no parallelism).

    seconds: max(memory_s, compute_s); bytes: HBM bytes read; flops: FLOPs; dtype: the matrix-unit
    dtype whose rate ``compute_s`` uses.
    """

    seconds: float
    memory_s: float
    compute_s: float
    bytes: float
    flops: float
    dtype: str


def moe_layer_cost(spec: ModelSpec, target: Target, *, tokens: int, weights: str,
                   compute_dtype: str | None = None) -> KernelCost:
    """The routed experts of one MoE layer for ``tokens`` tokens, as ``plan_cost`` counts them:
    expert bytes of the layer (stage 2's bytes for the ``weights`` format) times the expected
    fraction of experts the tokens reach, and 2 x tokens x top-k x (3 x hidden x expert width)
    FLOPs at the rate of ``_compute_dtype`` (or ``compute_dtype``: e.g. "bf16" for MXFP4 weights
    decoded to bf16 inside the GEMM)."""
    moe = spec.moe_layers
    if not moe:
        raise ValueError(f"{spec.source} has no MoE layers")
    ffn = moe[0].ffn
    memory = plan_memory(spec, target, devices=1, gpu_memory_utilization=VLLM_GPU_MEMORY_UTILIZATION,
                         layout=Layout(), search=False, context=1, batch=1, weights=weights)
    layer_bytes = memory.weights_by_component.get("routed_experts", 0) / len(moe)
    read = layer_bytes * _expert_hit_fraction(spec, tokens)
    dtype = compute_dtype or _compute_dtype(spec, target, weights)
    flops = 2.0 * tokens * ffn.top_k * 3 * spec.hidden * ffn.expert_intermediate
    memory_s, compute_s = read / target.hbm_bandwidth, flops / target.flops(dtype)
    return KernelCost(max(memory_s, compute_s), memory_s, compute_s, read, flops, dtype)


def attention_layer_cost(spec: ModelSpec, target: Target, *, tokens: int, sequences: int, attended: int,
                         kv_dtype: str) -> KernelCost:
    """One attention layer (DSA: indexer scoring + sparse MLA) for ``tokens`` query tokens over
    ``sequences`` sequences each attending to ``attended`` tokens, as ``plan_cost`` counts it:
    ``_attention_flops_and_reads`` divided by the layer count, FLOPs at the bf16 rate."""
    flops, reads = _attention_flops_and_reads(spec, Layout(), kv_dtype, tokens, attended)
    flops, reads = flops / spec.num_layers, reads * sequences / spec.num_layers
    memory_s, compute_s = reads / target.hbm_bandwidth, flops / target.flops("bf16")
    return KernelCost(max(memory_s, compute_s), memory_s, compute_s, reads, flops, "bf16")


# ---------------------------------------------------------------------------------------
# Solver


COST_TIE = 0.05  # relative decode-cost difference below which two plans count as equal


def _dimensions(layout) -> int:
    """How many parallel dimensions a layout uses (TP, PP, DP, DCP above 1)."""
    return sum(size > 1 for size in (layout.tp, layout.pp, layout.dp, layout.dcp))


def plan_parallel(
    spec: ModelSpec,
    target: Target,
    *,
    devices: int,
    nodes: int = 1,
    context: int,
    batch: int,
    kv_dtype: str = "bf16",
    weights: str = "as-stored",
    headroom: float = 0.2,
    checkpoint=None,
    max_num_batched_tokens: int | None = None,
    gpu_memory_utilization: float | None = None,
    block_size: int = 64,
    max_num_seqs: int | None = None,
    rope_factor: float | None = None,
) -> ParallelResult:
    """Enumerate, filter, cost and rank the layouts of ``devices`` devices over ``nodes`` nodes.

    Arguments as ``adapt.plan.layout.plan_memory``. Raises InputError for a device count the
    nodes or the target cannot hold, bad workload flags, or a context above the model's limit.
    """
    per_node = devices_per_node(target, devices, nodes)
    default_tokens, default_seqs = vllm_batch_defaults(target)
    options = dict(
        context=context,
        batch=batch,
        kv_dtype=kv_dtype,
        weights=weights,
        headroom=headroom,
        checkpoint=checkpoint_component_bytes(checkpoint, weights),
        max_num_batched_tokens=max_num_batched_tokens or default_tokens,
        block_size=block_size,
        max_num_seqs=max_num_seqs or default_seqs,
        rope_factor=rope_factor,
    )
    util = VLLM_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    # validates the workload flags once (context limit, dtypes, ...) before the enumeration
    plan_memory(spec, target, devices=1, gpu_memory_utilization=util, layout=Layout(), search=False, **options)

    candidates = enumerate_layouts(spec, devices, context)
    plans = [_memory_check(spec, target, layout, util, options) for layout in candidates]
    raised = False
    if gpu_memory_utilization is None and not any(p.feasible for p in plans):
        raised_plans = []
        for plan in plans:
            need = plan.memory.min_gpu_memory_utilization if plan.memory else None
            if need is not None and util < need <= MAX_RAISED_UTILIZATION:
                raised_plans.append(_memory_check(spec, target, plan.layout, need, options))
            else:
                raised_plans.append(plan)
        raised = any(p.feasible for p in raised_plans)
        plans = raised_plans
    single_node = any(p.feasible and not crosses_nodes(p.layout, per_node, nodes) for p in plans)
    for plan in plans:
        if not plan.feasible:
            continue
        spans = crosses_nodes(plan.layout, per_node, nodes)
        if spans and single_node:
            plan.feasible = False
            plan.reason = (
                f"{' and '.join(spans)} group spans nodes, but a layout inside one node fits; "
                f"cross-node links ({target.inter_node_bandwidth / 1e9:.0f} GB/s) are slower than "
                f"intra-node ({target.intra_node_bandwidth / 1e9:.0f} GB/s)"
            )
            continue
        plan.cost = plan_cost(spec, target, plan.memory, nodes=nodes, batch=batch)
    feasible = [p for p in plans if p.feasible]
    best = min((p.cost.decode_step_s for p in feasible), default=0.0)

    def rank(p):
        # The cost model is a roofline estimate: plans within COST_TIE of the best are equals, and
        # among equals the simpler layout (fewer parallel dimensions, as published recipes use) wins.
        tied = p.cost.decode_step_s <= best * (1 + COST_TIE)
        return (not tied, _dimensions(p.layout) if tied else 0, p.cost.decode_step_s,
                p.cost.prefill_chunk_s, p.layout.pp, p.layout.tp)

    feasible.sort(key=rank)
    rejected = [p for p in plans if not p.feasible]
    engine_args = _engine_args(feasible[0], options) if feasible else {}
    result = ParallelResult(
        model=spec.source,
        target=target.name,
        devices=devices,
        nodes=nodes,
        context=context,
        batch=batch,
        feasible=feasible,
        rejected=rejected,
        engine_args=engine_args,
        single_node_fits=single_node,
        raised_utilization=raised,
    )
    result.explanation = _explain(result, target)
    return result


def _memory_check(
    spec: ModelSpec, target: Target, layout: Layout, util: float, options: dict
) -> ParallelPlan:
    problems = layout_problems(spec, layout, options["weights"])
    if problems:
        return ParallelPlan(layout, False, "; ".join(problems), gpu_memory_utilization=util)
    memory = plan_memory(
        spec,
        target,
        devices=layout.devices,
        gpu_memory_utilization=util,
        layout=layout,
        search=False,
        **options,
    )
    plan = ParallelPlan(layout, memory.fits, memory=memory, gpu_memory_utilization=util)
    if not memory.fits:
        plan.reason = (
            f"memory: {memory.concurrent_sequences} of {memory.sequences_per_replica} sequences of "
            f"{memory.context:,} tokens fit per replica (KV pool {memory.kv_pool_bytes / GiB:,.1f} GiB, "
            f"binding term {memory.binding_term} {memory.terms[memory.binding_term] / GiB:,.1f} GiB)"
        )
    return plan


def extra_engine_args(spec: ModelSpec, plan: ParallelPlan, rope_factor: float | None) -> dict[str, Any]:
    """Engine arguments a plan needs beyond the ten plan keys: ``decode_context_parallel_size``
    for a DCP plan, and ``hf_overrides`` (``adapt.plan.launch.rope_override``: the model's own
    rope scaling with only the factor changed) when ``rope_factor`` extends the context past the
    model's own limit (base: the config's pre-scaling length, or max_position_embeddings)."""
    extra: dict[str, Any] = {}
    if plan.layout.dcp > 1:
        extra["decode_context_parallel_size"] = plan.layout.dcp
    if rope_factor is not None:
        from adapt.plan.launch import rope_override

        base = spec.rope.original_max_position or spec.max_position
        extra["hf_overrides"] = rope_override(spec.config.get("rope_scaling"), theta=spec.rope.theta, base=base,
                                              factor=rope_factor)
    return extra


def _engine_args(plan: ParallelPlan, options: dict) -> dict[str, Any]:
    """vLLM engine arguments of a plan (EngineArgs field names)."""
    memory = plan.memory
    assert memory is not None
    return {
        "tensor_parallel_size": plan.layout.tp,
        "pipeline_parallel_size": plan.layout.pp,
        "data_parallel_size": plan.layout.dp,
        "enable_expert_parallel": plan.layout.expert_parallel,
        "max_model_len": memory.context,
        "gpu_memory_utilization": plan.gpu_memory_utilization,
        "kv_cache_dtype": "auto" if memory.kv_dtype == "bf16" else "fp8",
        "block_size": memory.block_size,
        "max_num_batched_tokens": options["max_num_batched_tokens"],
        "max_num_seqs": options["max_num_seqs"],
    }


def _explain(result: ParallelResult, target: Target) -> list[str]:
    lines = []
    if not result.feasible:
        lines.append(
            f"No layout of {result.devices} x {target.name} holds {result.batch} sequence(s) of "
            f"{result.context:,} tokens; see the rejected plans."
        )
        return lines
    for rank, plan in enumerate(result.feasible[:3], start=1):
        c, m = plan.cost, plan.memory
        assert c is not None and m is not None
        comm = []
        if c.tp_allreduce_bytes:
            comm.append(f"TP all-reduce {c.tp_allreduce_bytes / 2**20:,.2f} MiB/step ({c.tp_link})")
        if c.ep_dispatch_bytes:
            comm.append(f"EP dispatch {c.ep_dispatch_bytes / 2**20:,.2f} MiB/step ({c.ep_link})")
        if c.pp_transfer_bytes:
            comm.append(f"PP hand-off {c.pp_transfer_bytes / 2**10:,.1f} KiB/stage ({c.pp_link})")
        lines.append(
            f"#{rank} {plan.label}: decode step {c.decode_step_s * 1e3:,.2f} ms (reads "
            f"{c.weight_read_bytes / GiB:,.2f} GiB weights + {c.kv_read_bytes / GiB:,.2f} GiB KV per device; "
            f"memory {c.decode_memory_s * 1e3:,.2f} ms, compute {c.decode_compute_s * 1e3:,.2f} ms, "
            f"communication {c.decode_comm_s * 1e3:,.2f} ms), prefill chunk "
            f"{c.prefill_chunk_s * 1e3:,.1f} ms; {m.terms['weights'] / GiB:,.1f} GiB weights and "
            f"{m.concurrent_sequences:,} concurrent sequences per device"
            + (f"; {', '.join(comm)}" if comm else "")
            + "."
        )
    if result.raised_utilization:
        lines.append(
            f"Nothing fits at gpu_memory_utilization {VLLM_GPU_MEMORY_UTILIZATION}; the plans above need "
            f"up to {MAX_RAISED_UTILIZATION}."
        )
    return lines


# ---------------------------------------------------------------------------------------
# Stage report


def _model_path(model: str) -> str:
    """What `vllm serve` should load: the directory for a directory or config.json, else the name."""
    path = Path(model)
    if path.is_dir():
        return str(path)
    if path.is_file():
        return str(path.parent)
    return model


def run_plan_parallel(
    model: str,
    target: str,
    *,
    gates: dict,
    kv_dtype: str = "bf16",
    weights: str = "as-stored",
    headroom: float | None = None,
    rope_factor: float | None = None,
    **plan_args: Any,
) -> StageReport:
    """Stage 4 as a gated report. ``plan_args``: ``plan_parallel``'s other keyword arguments
    (devices, nodes, context, batch, ...; not checkpoint, which comes from ``model``).
    ``gates["parallel"]["min_plans"]``: fewer feasible plans fail.
    Metrics hold ``engine_args``, ``serve_command`` (argv) and, for several nodes, ``ray_steps``."""
    from adapt.plan.launch import launch_lines, ray_steps, serve_command
    from adapt.targets.target import load_target

    started = now_iso()
    thresholds = gates.get("parallel", {})
    if headroom is None:
        headroom = float(gates.get("memory", {}).get("headroom_fraction", 0.2))
    spec, checkpoint = load_model(model)
    tgt = load_target(target)
    result = plan_parallel(
        spec,
        tgt,
        kv_dtype=kv_dtype,
        weights=weights,
        headroom=headroom,
        checkpoint=checkpoint,
        rope_factor=rope_factor,
        **plan_args,
    )
    devices, nodes, context, batch = result.devices, result.nodes, result.context, result.batch
    report = StageReport(stage="parallel", number=4, title="Parallel plan", started=started)
    report.summary = " ".join(result.explanation)
    model_path = _model_path(model)
    extra = extra_engine_args(spec, result.best, rope_factor) if result.best else {}
    report.metrics = {
        "engine_args": result.engine_args,
        "extra_engine_args": extra,
        "serve_command": serve_command(model_path, result.engine_args | extra) if result.engine_args else [],
        "best_plan": result.best.label if result.best else None,
        "feasible_plans": len(result.feasible),
        "rejected_plans": len(result.rejected),
        "single_node_fits": result.single_node_fits,
        "devices": devices,
        "nodes": nodes,
        "context": context,
        "batch": batch,
        "top_plans": [p.to_dict() for p in result.feasible[:3]],
    }
    if nodes > 1 and result.engine_args:
        report.metrics["ray_steps"] = ray_steps(model_path, result.engine_args | extra, nodes)
    launch = launch_lines(report.metrics)
    if launch:
        report.tables["launch"] = [{"step": i, "command": line} for i, line in enumerate(launch, start=1)]
    report.tables["ranked plans"] = [dict(rank=i, **p.row()) for i, p in enumerate(result.feasible, start=1)]
    report.tables["rejected plans"] = [p.row() for p in result.rejected]
    minimum = int(thresholds.get("min_plans", 1))
    if len(result.feasible) < minimum:
        report.add(
            "error",
            "parallel.no_plan",
            f"{len(result.feasible)} feasible plan(s) of {len(result.feasible) + len(result.rejected)} "
            f"(need {minimum})",
            "use more devices, a shorter --context, fewer --batch sequences, "
            "--kv-dtype fp8 or smaller --weights",
        )
    else:
        best = result.best
        assert best is not None
        report.add("info", "parallel.best", f"{best.label}: `{shlex.join(report.metrics['serve_command'])}`")
    if result.raised_utilization:
        report.add(
            "warn",
            "parallel.raised_utilization",
            f"no plan fits at gpu_memory_utilization {VLLM_GPU_MEMORY_UTILIZATION}; the best plan needs "
            f"{result.engine_args.get('gpu_memory_utilization')}",
            "little memory is left for anything outside vLLM's accounting on these devices",
        )
    if model_path == model and not Path(model).exists():
        report.add(
            "info",
            "parallel.model_path",
            f"the serve command names the preset {model!r}",
            "replace it with your checkpoint directory or Hugging Face repository id",
        )
    report.add(
        "info",
        "parallel.cost_model",
        "costs are roofline estimates from the target's rates (HBM, matrix units, links; datasheet or "
        "measured, see its sources); they rank plans, they do not predict latency "
        "(benchmarks/predict: adapt's kernels run 1.25-33x above them on an H200)",
    )
    report.fingerprint = fingerprint(
        spec_hash=spec.spec_hash(),
        target=tgt.name,
        devices=devices,
        nodes=nodes,
        context=context,
        batch=batch,
        kv_dtype=kv_dtype,
        weights=weights,
        gates=thresholds,
    )
    report.finished = now_iso()
    report.decide()
    return report
