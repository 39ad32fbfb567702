"""How many bytes each device needs, term by term, the way vLLM accounts for them: the layout,
sharding and memory rules that stage 2 (``adapt.stages.memory``, which turns one plan into its
gated report) and stage 4 (``adapt.stages.parallel``, which searches layouts with ``plan_memory``) share.

vLLM gives ``gpu_memory_utilization * device memory`` (the *budget*) to one worker. At start-up
it loads the weights, profiles one forward pass of ``max_num_batched_tokens`` tokens plus one
sampler pass of ``min(max_num_seqs, max_num_batched_tokens)`` requests, and, since v0.21,
estimates its CUDA-graph memory; whatever is left of the budget becomes the paged KV cache. It
refuses to start when that cache cannot hold one sequence of ``max_model_len`` tokens
(vllm/v1/core/kv_cache_utils.py: "To serve at least one request with the models's max seq
len ..."). This module predicts those terms per device for a parallel layout:

- weights: exact from checkpoint headers when a directory is given, otherwise from the
  ModelSpec's tensor inventory and the chosen storage format; split the way vLLM shards them
  (TP splits matrices, EP splits routed experts, PP splits layers, replicated parts count on
  every device); plus the padding vLLM's MXFP4 MoE kernels add to the expert layout;
- KV cache per token and per sequence (paged blocks), for GQA/MHA (KV heads replicated when
  TP exceeds their count), MLA latents (replicated on every TP rank), the DSA indexer key
  cache and sliding-window layers (bounded by their window);
- the activation peak (prefill chunk, decode batch, sampler), MoE dispatch buffers,
  communication buffers, CUDA graphs, framework overhead, the FP8 workspace of online MXFP4
  experts, and a headroom margin on every estimated (not exact) term.

Every constant below carries its source or says it is an estimate. Units: bytes, tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapt.errors import InputError
from adapt.model.spec import ModelSpec, QuantFormat, TensorSpec
from adapt.plan.headroom import Headroom, assess, margin_bytes
from adapt.targets.target import Target

GiB = 1024**3
MiB = 1024**2

WEIGHT_FORMATS = ("as-stored", "bf16", "fp8", "mxfp4-online", "mxfp4-offline-fp8")
KV_DTYPES = ("bf16", "fp8")
VERDICTS = ("fits", "fits-fewer-sequences", "does-not-fit")

# vLLM defaults (vllm/config/cache.py, vllm/engine/arg_utils.py EngineArgs.get_batch_defaults):
# gpu_memory_utilization 0.9; on GPUs with >= 70 GiB that are not A100s, `vllm serve` uses
# max_num_batched_tokens 8192 and max_num_seqs 1024, otherwise 2048 and 256.
VLLM_GPU_MEMORY_UTILIZATION = 0.9
VLLM_LARGE_GPU_BYTES = 70 * GiB
VLLM_BATCH_DEFAULTS = {True: (8192, 1024), False: (2048, 256)}
# vLLM pads the vocabulary to a multiple of 64 before splitting it over TP ranks
# (vllm/model_executor/layers/vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE).
VLLM_VOCAB_PADDING = 64
# vLLM's fused MoE processes at most this many tokens per call (vllm/envs.py,
# VLLM_FUSED_MOE_CHUNK_SIZE default 16 * 1024).
FUSED_MOE_CHUNK_TOKENS = 16 * 1024
# vLLM MLA keeps a latent workspace for chunked-prefill context of
# min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 128 * 1024) tokens
# (vllm/v1/attention/backends/mla/common.py, chunked_prefill_workspace_size).
MLA_WORKSPACE_MAX_TOKENS = 128 * 1024
# Estimate: bytes per (request x vocabulary entry) at the sampler's peak during vLLM's dummy
# sampler pass (top-k/top-p path): fp32 logits 4 + sorted values 4 + int64 sort indices 8 +
# softmax 4 + cumulative sum 4 + exponential noise 4 (vllm/v1/sample/ops/topk_topp_sampler.py).
SAMPLER_BYTES_PER_LOGIT = 28
# Estimate: vLLM's CUDA-graph memory, profiled since v0.21 (logs show 0.36 GiB and 0.65 GiB for
# single models, vllm-project/vllm PR #21489 and gpustack/runner#251).
CUDA_GRAPH_BYTES = 512 * MiB
# Estimate: non-torch memory of one worker (cuBLAS/cuBLASLt workspaces, attention-backend
# workspaces); vLLM logs "0.07 GiB for non-torch memory" for one GPU without NCCL (PR #21489).
FRAMEWORK_OVERHEAD_BYTES = 256 * MiB
# Estimate: NCCL buffers per communicator with more than one rank: NCCL_BUFFSIZE 4 MiB per
# channel and peer direction, ~32 channels on NVLink, both directions.
NCCL_BYTES_PER_GROUP = 256 * MiB
# vLLM's MXFP4 MoE layout pads each expert: Marlin (GPUs without FP4 units) rounds the
# intermediate size per partition up to 128 and the hidden size to 256; the FlashInfer/TRT-LLM
# path on FP4-capable GPUs rounds both to 256 (vllm/model_executor/layers/quantization/mxfp4.py,
# Mxfp4MoEMethod.create_weights). Keys: target has native fp4 units.
MXFP4_LAYOUT_ALIGN = {False: (128, 256), True: (256, 256)}  # (intermediate, hidden)
# FlashMLA's fp8 MLA cache entry per token and layer: kv_lora_rank e4m3 values, one fp32 scale
# per 128 of them, the rope part in bf16 (DeepSeek-V3.2: 512 + 16 + 128 = 656 B; vLLM
# "fp8_ds_mla"). The DSA indexer key cache holds index_head_dim e4m3 values + one fp32 scale.
FP8_MLA_SCALE_GROUP = 128
FP8_SCALE_BYTES = 4

_FP8_BLOCK = QuantFormat("fp8_block", (128, 128), "fp32")
_MXFP4 = QuantFormat("mxfp4", (1, 32), "e8m0")
_BF16 = QuantFormat("bf16")
_FP8_COMPONENTS = ("attention", "indexer", "routed_experts", "shared_experts", "dense_mlp")


@dataclass(frozen=True)
class Layout:
    """A parallel layout in vLLM's terms.

    tp: tensor-parallel ranks; pp: pipeline stages; dp: data-parallel replicas
    expert_parallel: routed experts split over the tp * dp ranks of a stage (vLLM
        ``--enable-expert-parallel``) instead of being split by TP and copied per replica
    dcp: decode context parallelism (vLLM ``--decode-context-parallel-size``): the TP ranks
        that would hold copies of the same KV entries (MLA latents, or KV heads replicated
        because TP exceeds them) stripe a sequence's tokens over ``dcp`` of them instead
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    dcp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ep(self) -> int:
        """Ranks that share the routed experts (1 without expert parallelism)."""
        return self.tp * self.dp if self.expert_parallel else 1

    def label(self) -> str:
        parts = [f"TP{self.tp}"]
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.dp > 1:
            parts.append(f"DP{self.dp}")
        if self.expert_parallel:
            parts.append(f"EP{self.ep}")
        if self.dcp > 1:
            parts.append(f"DCP{self.dcp}")
        return " x ".join(parts)


@dataclass
class MemoryPlan:
    """Bytes per device for one model, target, layout and workload; the most loaded device.

    terms: name -> bytes on the binding device (weights, weight_layout_padding,
        mxfp4_fp8_workspace, activations, moe_dispatch_buffers, communication_buffers,
        cuda_graphs, framework_overhead, headroom, kv_cache = KV for the requested sequences)
    exact_terms / estimated_terms: which terms are computed exactly and which are estimates
    weights_by_component: component -> weight bytes on the binding device
    activation_detail: prefill_chunk / decode_batch / sampler peaks in bytes
    kv_bytes_per_token: layer group -> bytes per token per device (full, sliding, mla_latent,
        dsa_indexer); kv_bytes_per_sequence: bytes of one sequence of ``context`` tokens
    kv_pool_bytes: budget minus every non-KV term (what vLLM hands to the KV cache; may be < 0)
    concurrent_sequences: sequences of ``context`` tokens the pool holds per replica
    verdict: "fits" | "fits-fewer-sequences" (vLLM starts, fewer than ``batch`` sequences fit)
        | "does-not-fit" (vLLM refuses to start)
    binding_term: the largest term of the demand; fewest_devices: the fewest devices of this
        target that fit the workload (None: none up to the target's limit); longest_context:
        the longest context at which ``batch`` sequences fit with this layout (0: none)
    min_gpu_memory_utilization: the smallest gpu_memory_utilization that fits (None: > 0.99)
    images, image_size: images per request and their (height, width) in pixels;
        image_tokens_per_request: the tokens they add to every sequence's KV (beyond ``context``)
    recurrent_state_bytes_per_sequence: the constant linear-attention state in
        kv_bytes_per_sequence (0 without linear-attention layers)
    """

    model: str
    target: str
    layout: Layout
    nodes: int
    context: int
    batch: int
    kv_dtype: str
    weights_format: str
    weights_source: str
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float
    headroom: float
    device_memory_bytes: int
    budget_bytes: int
    terms: dict[str, int]
    exact_terms: tuple[str, ...]
    estimated_terms: tuple[str, ...]
    weights_by_component: dict[str, int]
    activation_detail: dict[str, int]
    kv_bytes_per_token: dict[str, int]
    kv_bytes_per_sequence: int
    kv_pool_bytes: int
    sequences_per_replica: int
    concurrent_sequences: int
    verdict: str
    binding_term: str
    binding_stage: int
    fewest_devices: int | None
    longest_context: int
    min_gpu_memory_utilization: float | None
    mxfp4_comparison: dict[str, int] = field(default_factory=dict)
    explanation: list[str] = field(default_factory=list)
    images: int = 0
    image_size: tuple[int, int] = (0, 0)
    image_tokens_per_request: int = 0
    recurrent_state_bytes_per_sequence: int = 0

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"

    @property
    def non_kv_bytes(self) -> int:
        return sum(v for k, v in self.terms.items() if k != "kv_cache")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layout"] = {
            **asdict(self.layout),
            "ep": self.layout.ep,
            "devices": self.layout.devices,
            "label": self.layout.label(),
        }
        data["exact_terms"] = list(self.exact_terms)
        data["estimated_terms"] = list(self.estimated_terms)
        data["terms_gib"] = {k: round(v / GiB, 3) for k, v in self.terms.items()}
        data["budget_gib"] = round(self.budget_bytes / GiB, 3)
        data["kv_pool_gib"] = round(self.kv_pool_bytes / GiB, 3)
        return data


# ---------------------------------------------------------------------------------------
# Inputs


def vllm_batch_defaults(target: Target) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` picks on this target's devices."""
    return VLLM_BATCH_DEFAULTS[
        target.memory_bytes >= VLLM_LARGE_GPU_BYTES and "a100" not in target.name.lower()
    ]


def context_limit(spec: ModelSpec, rope_factor: float | None = None) -> int:
    """Longest context the model supports (tokens): max_position_embeddings, or, with a
    rope-scaling factor, the pre-scaling length times that factor."""
    if rope_factor is None:
        return spec.max_position
    base = spec.rope.original_max_position or spec.max_position
    return int(base * rope_factor)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ffn_widths(spec: ModelSpec) -> list[tuple[str, int, int | None]]:
    """(what, width, quantization block width or None) for every TP-split FFN width."""
    out = []
    seen = set()
    for layer in spec.layers:
        f = layer.ffn
        items = (
            [("dense FFN intermediate size", f.intermediate, "dense_mlp")]
            if f.kind == "dense"
            else [("expert intermediate size", f.expert_intermediate, "routed_experts")]
        )
        if f.kind == "moe" and f.num_shared_experts:
            items.append(("shared expert intermediate size", f.shared_intermediate, "shared_experts"))
        for what, width, component in items:
            if (what, width) in seen:
                continue
            seen.add((what, width))
            fmt = spec.quant.format_of(component)
            block = fmt.block_size[0] if fmt.method == "fp8_block" and fmt.block_size else None
            out.append((what, width, block))
    return out


def layout_problems(spec: ModelSpec, layout: Layout, weights: str = "as-stored") -> list[str]:
    """Why vLLM cannot run ``spec`` with ``layout`` (empty when it can).

    Rules: attention heads divisible by TP; KV heads divisible by TP or TP divisible by them
    (replication); without EP, every TP-split FFN width divisible by TP and, for fp8 block
    weights, each shard a multiple of the 128-wide block (vLLM's "not divisible by weight
    quantization block_n"); with EP, routed experts divisible by the EP size; PP no larger than
    the layer count. The vocabulary is padded to a multiple of 64 per rank, never rejected.
    """
    problems = []
    tp = layout.tp
    attn = spec.layers[0].attention
    heads, kv = attn.num_heads, attn.num_kv_heads
    if heads % tp:
        problems.append(f"TP {tp} does not divide {heads} attention heads")
    if attn.kind not in ("mla", "mla+dsa") and kv % tp and tp % kv:
        problems.append(f"TP {tp} and {kv} KV heads: neither divides the other")
    moe = spec.moe_layers
    if moe and layout.expert_parallel and moe[0].ffn.num_experts % layout.ep:
        problems.append(f"EP {layout.ep} does not divide {moe[0].ffn.num_experts} routed experts")
    for what, width, block in _ffn_widths(spec):
        if what == "expert intermediate size" and layout.expert_parallel:
            continue
        if width % tp:
            problems.append(f"TP {tp} does not divide the {what} {width}")
        elif block and weights in ("as-stored", "fp8") and (width // tp) % block:
            problems.append(
                f"TP {tp} splits the {what} {width} into {width // tp}, not a multiple of "
                f"the fp8 weight block {block}"
            )
    problems += _hybrid_layout_problems(spec, tp)
    if layout.dcp > 1 and any(layer.attention.kind == "linear" for layer in spec.layers):
        problems.append("decode context parallelism is not modelled for linear-attention state")
    if layout.pp > spec.num_layers:
        problems.append(f"PP {layout.pp} exceeds the {spec.num_layers} layers")
    if layout.dcp > 1:
        copies = kv_copies(spec, tp)
        if attn.kind == "mla+dsa":
            problems.append("decode context parallelism is not modelled for DSA attention (indexer cache)")
        elif copies % layout.dcp:
            problems.append(
                f"DCP {layout.dcp} does not divide the {copies} TP ranks holding the same KV entries"
            )
    return problems


def _hybrid_layout_problems(spec: ModelSpec, tp: int) -> list[str]:
    """Head splits of the layers unlike layer 0 (a hybrid model's full-attention layers when
    layer 0 is linear attention, and the reverse): vLLM divides Gated DeltaNet key and value
    heads by TP exactly, attention heads by TP and KV heads by TP or TP by them."""
    first = spec.layers[0].attention
    problems = []
    for a in {layer.attention for layer in spec.layers if layer.attention != first}:
        if a.kind == "linear":
            for what, n in (("linear-attention key heads", a.linear_key_heads),
                            ("linear-attention value heads", a.linear_value_heads)):
                if n % tp:
                    problems.append(f"TP {tp} does not divide the {n} {what}")
        elif a.kind not in ("mla", "mla+dsa"):
            if a.num_heads % tp:
                problems.append(f"TP {tp} does not divide {a.num_heads} attention heads")
            if a.num_kv_heads % tp and tp % a.num_kv_heads:
                problems.append(f"TP {tp} and {a.num_kv_heads} KV heads: neither divides the other")
    if first.kind == "linear" and first.linear_key_heads % tp:
        problems.append(f"TP {tp} does not divide the {first.linear_key_heads} linear-attention key heads")
    return sorted(set(problems))


def kv_copies(spec: ModelSpec, tp: int) -> int:
    """How many TP ranks hold the same KV entries: all of them for MLA latents, TP / KV heads
    when TP exceeds the KV heads, else 1 (a hybrid model: its first attention layer with a KV cache)."""
    attn = next((layer.attention for layer in spec.layers if layer.attention.kind != "linear"),
                spec.layers[0].attention)
    if attn.kind in ("mla", "mla+dsa"):
        return tp
    return max(1, tp // attn.num_kv_heads)


def devices_per_node(target: Target, devices: int, nodes: int) -> int:
    """Devices on each of ``nodes`` nodes (InputError naming the flag when ``devices`` cannot
    split evenly over them or the target's nodes cannot hold them)."""
    if devices < 1:
        raise InputError(f"expected a positive device count, got {devices}", field="--devices")
    if nodes < 1:
        raise InputError(f"expected a positive node count, got {nodes}", field="--nodes")
    if devices % nodes:
        raise InputError(
            f"--devices {devices} does not split evenly over --nodes {nodes}",
            field="--devices",
            hint=f"use a multiple of {nodes}",
        )
    per_node = devices // nodes
    if per_node > target.devices_per_node:
        raise InputError(
            f"{per_node} devices per node, but a {target.name} node has {target.devices_per_node}",
            field="--devices",
            hint=f"use at most {target.devices_per_node * nodes} devices on {nodes} node(s) or add --nodes",
        )
    if nodes > target.max_nodes:
        raise InputError(
            f"--nodes {nodes} exceeds the target's max_nodes {target.max_nodes}", field="--nodes"
        )
    return per_node


def resolve_layout(
    spec: ModelSpec,
    target: Target,
    *,
    devices: int,
    nodes: int,
    tp: int | None,
    ep: int | None,
    pp: int | None,
    dp: int | None,
    weights: str,
    dcp: int | None = None,
) -> Layout:
    """The layout the flags ask for (InputError naming the flag and the fix when it cannot work).

    Unset sizes default to: PP = nodes, TP = devices per node, DP = 1, no EP.
    """
    per_node = devices_per_node(target, devices, nodes)
    for flag, value in (("--tp", tp), ("--ep", ep), ("--pp", pp), ("--dp", dp)):
        if value is not None and value < 1:
            raise InputError(f"expected a positive integer, got {value}", field=flag)
    given = [v for v in (tp, pp, dp) if v is not None]
    if not given:
        pp, dp = nodes, 1
        tp = per_node
        source = "--devices"
    else:
        known = math.prod(given)
        if devices % known:
            raise InputError(
                f"--tp/--pp/--dp multiply to {known}, which does not divide --devices {devices}",
                field="--devices",
                hint="TP x PP x DP must equal the device count",
            )
        rest = devices // known
        if tp is None:
            tp, rest = rest, 1
        elif dp is None:
            dp, rest = rest, 1
        elif pp is None:
            pp, rest = rest, 1
        pp, dp = pp or 1, dp or 1
        if rest != 1:
            raise InputError(
                f"TP {tp} x PP {pp} x DP {dp} = {tp * pp * dp}, not --devices {devices}",
                field="--devices",
                hint="TP x PP x DP must equal the device count",
            )
        source = "--tp"
    expert_parallel = ep is not None and ep > 1
    if expert_parallel and ep != tp * dp:
        raise InputError(
            f"--ep {ep} must be 1 or TP x DP = {tp * dp}",
            field="--ep",
            hint="vLLM's expert parallelism spans the TP x DP ranks of a pipeline stage",
        )
    if expert_parallel and not spec.moe_layers:
        raise InputError("--ep needs a mixture-of-experts model", field="--ep")
    if dcp is not None and dcp < 1:
        raise InputError(f"expected a positive integer, got {dcp}", field="--dcp")
    layout = Layout(tp=tp, pp=pp, dp=dp, expert_parallel=expert_parallel, dcp=dcp or 1)
    attn = spec.layers[0].attention
    if attn.num_heads % tp:
        good = ", ".join(str(d) for d in divisors(attn.num_heads) if d <= max(target.devices_per_node, tp))
        raise InputError(
            f"{source} {tp} does not divide {attn.num_heads} attention heads; use {good}",
            field=source,
            hint="or split the devices with --pp/--dp",
        )
    problems = layout_problems(spec, layout, weights)
    if problems:
        raise InputError(
            f"{layout.label()} cannot run {spec.source}: {problems[0]}",
            field=source,
            hint="choose other --tp/--ep/--pp/--dp, or let `adapt plan-parallel` choose",
        )
    return layout


# ---------------------------------------------------------------------------------------
# Weights


def tensor_format(spec: ModelSpec, tensor: TensorSpec, weights: str) -> QuantFormat:
    """Storage format of one tensor under a weights option.

    as-stored: the checkpoint's; bf16: everything bf16; fp8: quantizable matrices of attention,
    indexer, experts, shared experts and dense FFNs as fp8 block 128x128 (fp32 scales), the rest
    as stored; mxfp4-online: routed experts MXFP4, the rest as stored; mxfp4-offline-fp8: routed
    experts fp8 block, the rest as stored.
    """
    stored = spec.tensor_format(tensor)
    if weights == "as-stored":
        return stored
    if weights == "bf16":
        return _BF16
    expert_matrix = tensor.quantizable and tensor.component == "routed_experts"
    if weights == "fp8":
        return _FP8_BLOCK if tensor.quantizable and tensor.component in _FP8_COMPONENTS else stored
    if weights == "mxfp4-online":
        return _MXFP4 if expert_matrix else stored
    if weights == "mxfp4-offline-fp8":
        return _FP8_BLOCK if expert_matrix else stored
    raise InputError(
        f"unknown weights format {weights!r}; expected one of {', '.join(WEIGHT_FORMATS)}", field="--weights"
    )


def _share_kind(tensor: TensorSpec) -> str:
    """How vLLM splits one tensor: "vocab" (vocabulary-parallel), "replicated", "experts"
    (by EP, else by TP), "kv" (KV heads by TP, replicated past their count) or "tp"."""
    name, component = tensor.name, tensor.component
    if component in ("embeddings", "lm_head"):
        return "vocab"
    if component in ("norms", "router", "indexer"):
        return "replicated"
    if component == "routed_experts":
        return "experts"
    if component == "attention":
        replicated = (
            "q_a_proj",
            "kv_a_proj_with_mqa",
            "q_a_layernorm",
            "kv_a_layernorm",
            "q_norm",
            "k_norm",
            "o_proj.bias",
        )
        if any(part in name for part in replicated):
            return "replicated"
        if ".k_proj." in name or ".v_proj." in name:
            return "kv"
        return "tp"
    if component in ("shared_experts", "dense_mlp"):
        return "tp"
    return "replicated"


def _share(spec: ModelSpec, kind: str, layout: Layout, kv_heads: int) -> float:
    """Fraction of a tensor of this kind that one device of its stage holds."""
    tp = layout.tp
    if kind == "vocab":
        padded = -(-spec.vocab // (VLLM_VOCAB_PADDING * tp)) * VLLM_VOCAB_PADDING * tp
        return padded / tp / spec.vocab
    if kind == "experts":
        return 1.0 / layout.ep if layout.expert_parallel else 1.0 / tp
    if kind == "kv":
        return max(1, kv_heads // tp) / kv_heads
    if kind == "tp":
        return 1.0 / tp
    return 1.0


_GROUPS: dict[tuple[int, str], tuple[ModelSpec, list[tuple[str, int | None, str, int, int]]]] = {}


def _weight_groups(spec: ModelSpec, weights: str) -> list[tuple[str, int | None, str, int, int]]:
    """(component, layer position or None, share kind, KV heads, bytes) summed over the main
    model's tensors in a weights format; cached per spec object."""
    key = (id(spec), weights)
    cached = _GROUPS.get(key)
    if cached is not None and cached[0] is spec:
        return cached[1]
    positions = {layer.index: pos for pos, layer in enumerate(spec.layers)}
    sums: dict[tuple[str, int | None, str, int], int] = {}
    for t in spec.tensors(include_mtp=False):
        pos = positions[t.layer] if t.layer is not None else None
        kv = spec.layers[pos].attention.num_kv_heads if pos is not None else 1
        group = (t.component, pos, _share_kind(t), kv)
        sums[group] = sums.get(group, 0) + tensor_format(spec, t, weights).tensor_bytes(t.shape)
    groups = [(*group, nbytes) for group, nbytes in sums.items()]
    if len(_GROUPS) > 64:
        _GROUPS.clear()
    _GROUPS[key] = (spec, groups)
    return groups


def pp_stages(num_layers: int, pp: int) -> list[range]:
    """Layer positions per pipeline stage, as vLLM splits them (vllm/distributed/utils.py
    get_pp_indices): equal parts, the remainder going to the stages before the last."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class _StageWeights:
    by_component: dict[str, float]
    layout_padding: float
    expert_bytes: float


def _stage_weights(
    spec: ModelSpec,
    layout: Layout,
    weights: str,
    stage: int,
    layers: range,
    target: Target,
    checkpoint_bytes: dict[str, int] | None,
) -> _StageWeights:
    """Weight bytes on one device of pipeline stage ``stage`` (covering main-model ``layers``).
    Embeddings live on the first stage; lm_head and the final norm on the last."""
    last = stage == layout.pp - 1
    by_component: dict[str, float] = {}
    totals: dict[str, float] = {}
    for component, pos, kind, kv, nbytes in _weight_groups(spec, weights):
        totals[component] = totals.get(component, 0) + nbytes
        if pos is not None:
            here = pos in layers
        elif component in ("embeddings", "vision", "projector"):
            here = stage == 0  # the vision tower feeds the embeddings
        else:
            here = last
        if here:
            by_component[component] = by_component.get(component, 0) + nbytes * _share(spec, kind, layout, kv)
    if checkpoint_bytes is not None:
        by_component = _scale_to_checkpoint(by_component, totals, checkpoint_bytes)
    padding = 0.0
    expert_fmt = _routed_expert_format(spec, weights)
    if weights == "as-stored" and expert_fmt is not None and expert_fmt.method == "mxfp4":
        padding = _mxfp4_padding(spec, layout, layers, target)
    return _StageWeights(by_component, padding, by_component.get("routed_experts", 0.0))


def _scale_to_checkpoint(
    by_component: dict[str, float], totals: dict[str, float], checkpoint_bytes: dict[str, int]
) -> dict[str, float]:
    """Replace spec-derived bytes by the checkpoint's exact per-component bytes, keeping each
    component's device share. Scale tensors ("scales") follow the quantized components' share;
    unrecognised tensors ("other") count on every device."""
    out = {}
    for component, device_bytes in by_component.items():
        share = device_bytes / totals[component] if totals.get(component) else 0.0
        out[component] = checkpoint_bytes.get(component, 0) * share
    quantized = [
        c for c in ("attention", "indexer", "routed_experts", "shared_experts", "dense_mlp") if totals.get(c)
    ]
    if checkpoint_bytes.get("scales"):
        whole = sum(totals[c] for c in quantized)
        here = sum(by_component.get(c, 0.0) for c in quantized)
        out["scales"] = checkpoint_bytes["scales"] * (here / whole if whole else 1.0)
    if checkpoint_bytes.get("other"):
        out["other"] = float(checkpoint_bytes["other"])
    return out


def _routed_expert_format(spec: ModelSpec, weights: str) -> QuantFormat | None:
    for t in spec.tensors(include_mtp=False):
        if t.component == "routed_experts" and t.quantizable:
            return tensor_format(spec, t, weights)
    return None


def _mxfp4_padding(spec: ModelSpec, layout: Layout, layers: range, target: Target) -> float:
    """Extra bytes vLLM's MXFP4 MoE layout adds to the routed experts of one device."""
    align_i, align_h = MXFP4_LAYOUT_ALIGN["fp4" in target.native_dtypes or "mxfp4" in target.native_dtypes]
    extra = 0.0
    for pos in layers:
        f = spec.layers[pos].ffn
        if f.kind != "moe":
            continue
        width = f.expert_intermediate if layout.expert_parallel else f.expert_intermediate // layout.tp
        local_experts = f.num_experts / layout.ep if layout.expert_parallel else f.num_experts
        padded_w = -(-width // align_i) * align_i
        padded_h = -(-spec.hidden // align_h) * align_h
        before = _MXFP4.tensor_bytes((3 * width, spec.hidden))
        after = _MXFP4.tensor_bytes((2 * padded_w, padded_h)) + _MXFP4.tensor_bytes((padded_h, padded_w))
        bias = (2 * (padded_w - width) + (padded_h - spec.hidden)) * 2 if f.bias else 0
        extra += local_experts * (after - before + bias)
    return extra


# ---------------------------------------------------------------------------------------
# KV cache


def kv_bytes_per_token(
    spec: ModelSpec, layout: Layout, kv_dtype: str, layers: range | None = None
) -> dict[str, int]:
    """KV-cache bytes per token on the device that holds the token, per layer group (with
    decode context parallelism a device holds 1/dcp of a sequence's tokens).

    full: full-attention GQA/MHA layers, 2 (K, V) x KV heads per rank (at least one: heads are
        replicated when TP exceeds them) x head dim x element bytes
    sliding: sliding-window layers (same per token; a sequence holds only its window)
    mla_latent: MLA latent (kv_lora_rank + rope dim) per layer, replicated on every TP rank;
        bf16 2 B per value; fp8: FlashMLA's format for DSA models (656 B for DeepSeek-V3.2),
        else 1 B per value
    dsa_indexer: DSA indexer keys, index_head_dim fp8 values + one fp32 scale per layer
    """
    elem = 2 if kv_dtype == "bf16" else 1
    out = {"full": 0, "sliding": 0, "mla_latent": 0, "dsa_indexer": 0}
    chosen = spec.layers if layers is None else [spec.layers[i] for i in layers]
    for layer in chosen:
        a = layer.attention
        if a.kind == "linear":
            continue  # constant per-sequence state: recurrent_state_bytes
        if a.kind in ("mla", "mla+dsa"):
            if kv_dtype == "bf16":
                out["mla_latent"] += (a.kv_lora_rank + a.qk_rope_head_dim) * 2
            elif a.kind == "mla+dsa":
                scales = -(-a.kv_lora_rank // FP8_MLA_SCALE_GROUP) * FP8_SCALE_BYTES
                out["mla_latent"] += a.kv_lora_rank + scales + a.qk_rope_head_dim * 2
            else:
                out["mla_latent"] += a.kv_lora_rank + a.qk_rope_head_dim
            if a.kind == "mla+dsa":
                out["dsa_indexer"] += a.index_head_dim + FP8_SCALE_BYTES
            continue
        heads = max(1, a.num_kv_heads // layout.tp)
        per_token = heads * (a.head_dim + a.v_head_dim) * elem
        out["sliding" if a.window else "full"] += per_token
    return out


def kv_bytes_per_sequence(
    spec: ModelSpec, layout: Layout, kv_dtype: str, context: int, block_size: int, layers: range | None = None
) -> int:
    """KV bytes one sequence of ``context`` tokens occupies on one device, in whole pages of
    ``block_size`` tokens. Sliding-window layers keep the pages covering their window plus the
    page being written (vLLM's sliding-window manager frees the older ones)."""
    per = kv_bytes_per_token(spec, layout, kv_dtype, layers)
    pages = _cdiv(_cdiv(context, layout.dcp), block_size)
    state = recurrent_state_bytes(spec, layout, layers)
    total = (per["full"] + per["mla_latent"] + per["dsa_indexer"]) * pages * block_size
    if per["sliding"]:
        windows = {
            spec.layers[i].attention.window
            for i in (layers or range(spec.num_layers))
            if spec.layers[i].attention.window
        }
        window = max(windows)
        window_pages = _cdiv(_cdiv(window - 1, layout.dcp), block_size) + 1
        total += per["sliding"] * min(pages, window_pages) * block_size
    return total + state


def recurrent_state_bytes(spec: ModelSpec, layout: Layout, layers: range | None = None) -> int:
    """Bytes of one sequence's recurrent state on one device: for every linear-attention (Gated
    DeltaNet) layer, the conv state (conv channels / TP) x (kernel - 1) and the recurrent state
    (value heads / TP) x key dim x value dim, both in the model dtype (vLLM's default
    mamba_ssm_cache_dtype "auto"). Constant in the context length; vLLM's hybrid KV cache
    manager keeps it in its own pages beside the attention KV (MambaSpec)."""
    elem = 4 if spec.dtype == "float32" else 2
    total = 0
    for i in layers if layers is not None else range(spec.num_layers):
        a = spec.layers[i].attention
        if a.kind != "linear":
            continue
        conv = (2 * a.linear_key_heads * a.linear_key_dim + a.linear_value_heads * a.linear_value_dim) // layout.tp
        state = a.linear_value_heads // layout.tp * a.linear_key_dim * a.linear_value_dim
        total += (conv * (a.conv_kernel - 1) + state) * elem
    return total


def image_tokens_per_request(spec: ModelSpec, images: int, image_size: tuple[int, int]) -> int:
    """Language-model tokens (and KV entries) ``images`` images of ``image_size`` (height,
    width) pixels add to one request (ModelSpec's VisionSpec.image_tokens)."""
    if images <= 0 or spec.vision is None:
        return 0
    return images * spec.vision.image_tokens(*image_size)


def vision_activation_bytes(spec: ModelSpec, images: int, image_size: tuple[int, int]) -> int:
    """Estimated activation peak of the vision tower over one request's images (bf16): residual,
    normed input, q/k/v, attention output and the MLP intermediate of every encoder token at
    once (attention by a flash/varlen kernel: no tokens x tokens scores), plus the merged
    tokens through the projector. vLLM encodes images apart from the language model's forward,
    so this peak is compared with the language model's, not added to it."""
    if images <= 0 or spec.vision is None:
        return 0
    v = spec.vision
    tokens = images * v.encoder_tokens(*image_size)
    merged = tokens // (v.merge[0] * v.merge[1])
    return tokens * (6 * v.hidden + v.intermediate) * 2 + merged * 2 * (v.hidden * v.merge[0] * v.merge[1]) * 2


# ---------------------------------------------------------------------------------------
# Activations and buffers (estimates)


def _layer_activation(spec: ModelSpec, layer, layout: Layout, tokens: int, moe_tokens: int) -> int:
    """Transient bytes of one layer's forward over ``tokens`` tokens on one device (bf16):
    attention projections and outputs, or FFN / fused-MoE intermediate caches, whichever is larger."""
    a, f, h, tp = layer.attention, layer.ffn, spec.hidden, layout.tp
    heads = a.num_heads // tp
    if a.kind in ("mla", "mla+dsa"):
        attn = (
            tokens
            * (
                (a.q_lora_rank or 0)
                + a.kv_lora_rank
                + a.qk_rope_head_dim
                + heads * (a.head_dim + a.qk_nope_head_dim + 2 * a.v_head_dim)
            )
            * 2
        )
        if a.kind == "mla+dsa":
            attn += tokens * a.index_n_heads * a.index_head_dim + tokens * tokens * 4
    else:
        kv = max(1, a.num_kv_heads // tp)
        attn = tokens * (heads * a.head_dim + kv * (a.head_dim + a.v_head_dim) + heads * a.v_head_dim) * 2
    if f.kind == "dense":
        ffn = tokens * 3 * (f.intermediate // tp) * 2
    else:
        width = f.expert_intermediate if layout.expert_parallel else f.expert_intermediate // tp
        chunk = min(moe_tokens, FUSED_MOE_CHUNK_TOKENS)
        ffn = chunk * f.top_k * (max(2 * width, h) + width) * 2 + moe_tokens * f.num_experts * 4
        if f.num_shared_experts:
            ffn += tokens * 3 * (f.shared_intermediate // tp) * 2
    return max(attn, ffn)


def forward_activation_bytes(spec: ModelSpec, layout: Layout, tokens: int, layers: range) -> int:
    """Estimated activation peak of a forward pass over ``tokens`` tokens on one device: three
    hidden-size buffers (residual, normed input, layer output) plus the largest layer transient.
    With EP, vLLM's default all-gather dispatch hands every rank the tokens of all DP replicas."""
    if tokens <= 0:
        return 0
    moe_tokens = tokens * layout.dp if layout.expert_parallel else tokens
    peak = max(_layer_activation(spec, spec.layers[i], layout, tokens, moe_tokens) for i in layers)
    return 3 * tokens * spec.hidden * 2 + peak


def sampler_bytes(spec: ModelSpec, requests: int) -> int:
    """Estimated peak of vLLM's sampler pass over ``requests`` rows of full-vocabulary logits."""
    return requests * spec.vocab * SAMPLER_BYTES_PER_LOGIT


def moe_dispatch_bytes(spec: ModelSpec, layout: Layout, tokens: int) -> int:
    """Estimated EP dispatch buffers: vLLM's default all-gather/reduce-scatter backend gathers the
    hidden states (bf16) and router logits (fp32) of all DP replicas on every rank."""
    if not layout.expert_parallel or not spec.moe_layers:
        return 0
    experts = spec.moe_layers[0].ffn.num_experts
    gathered = tokens * layout.dp
    return gathered * spec.hidden * 2 + gathered * experts * 4


def communication_bytes(layout: Layout) -> int:
    """Estimated NCCL buffers: one communicator per parallel group with more than one rank."""
    groups = sum(1 for size in (layout.tp, layout.pp, layout.dp, layout.ep) if size > 1)
    return groups * NCCL_BYTES_PER_GROUP


def mxfp4_workspace_bytes(spec: ModelSpec, layout: Layout, tokens: int) -> int:
    """FP8 workspace for online MXFP4 -> FP8 experts: one layer's experts computed at once (the
    local experts a chunk of ``tokens`` tokens can reach), shared by all layers."""
    moe = spec.moe_layers
    if not moe:
        return 0
    f = moe[0].ffn
    local = f.num_experts // layout.ep if layout.expert_parallel else f.num_experts
    width = f.expert_intermediate if layout.expert_parallel else f.expert_intermediate // layout.tp
    concurrent = min(local, tokens * f.top_k)
    per_expert = _FP8_BLOCK.tensor_bytes((2 * width, spec.hidden)) + _FP8_BLOCK.tensor_bytes(
        (spec.hidden, width)
    )
    return concurrent * per_expert


# ---------------------------------------------------------------------------------------
# The planner


@dataclass
class _StageResult:
    stage: int
    terms: dict[str, float]
    weights_by_component: dict[str, float]
    activation_detail: dict[str, int]
    kv_per_token: dict[str, int]
    kv_per_sequence: int
    layers: range


def _stage_terms(
    spec: ModelSpec,
    target: Target,
    layout: Layout,
    *,
    stage: int,
    layers: range,
    weights: str,
    kv_dtype: str,
    context: int,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    headroom: float,
    decode_tokens: int,
    checkpoint_bytes: dict[str, int] | None,
    image_tokens: int = 0,
    vision_activation: int = 0,
) -> _StageResult:
    w = _stage_weights(spec, layout, weights, stage, layers, target, checkpoint_bytes)
    prefill = forward_activation_bytes(spec, layout, max_num_batched_tokens, layers)
    decode = forward_activation_bytes(spec, layout, decode_tokens, layers)
    last = stage == layout.pp - 1
    sampler = sampler_bytes(spec, min(max_num_seqs, max_num_batched_tokens)) if last else 0
    mla = [spec.layers[i].attention for i in layers if spec.layers[i].attention.kind in ("mla", "mla+dsa")]
    workspace_tokens = min(max(8 * context, 4 * max_num_seqs * block_size), MLA_WORKSPACE_MAX_TOKENS)
    mla_workspace = workspace_tokens * (mla[0].kv_lora_rank + mla[0].qk_rope_head_dim) * 2 if mla else 0
    vision = vision_activation if stage == 0 else 0
    activations = max(prefill, decode, sampler, vision) + mla_workspace
    terms: dict[str, float] = {
        "weights": sum(w.by_component.values()),
        "weight_layout_padding": w.layout_padding,
        "mxfp4_fp8_workspace": (
            mxfp4_workspace_bytes(spec, layout, max_num_batched_tokens) if weights == "mxfp4-online" else 0
        ),
        "activations": activations,
        "moe_dispatch_buffers": moe_dispatch_bytes(spec, layout, max_num_batched_tokens),
        "communication_buffers": communication_bytes(layout),
        "cuda_graphs": CUDA_GRAPH_BYTES,
        "framework_overhead": FRAMEWORK_OVERHEAD_BYTES,
    }
    estimated = sum(terms[k] for k in ESTIMATED_TERMS if k != "headroom")
    terms["headroom"] = margin_bytes(estimated, headroom)
    per_token = kv_bytes_per_token(spec, layout, kv_dtype, layers)
    per_seq = kv_bytes_per_sequence(spec, layout, kv_dtype, context + image_tokens, block_size, layers)
    detail = {
        "prefill_chunk": prefill,
        "decode_batch": decode,
        "sampler": sampler,
        "mla_workspace": mla_workspace,
    }
    if spec.vision is not None:
        detail["vision_encoder"] = vision
    return _StageResult(stage, terms, w.by_component, detail, per_token, per_seq, layers)


EXACT_TERMS = ("weights", "kv_cache")
ESTIMATED_TERMS = (
    "weight_layout_padding",
    "mxfp4_fp8_workspace",
    "activations",
    "moe_dispatch_buffers",
    "communication_buffers",
    "cuda_graphs",
    "framework_overhead",
    "headroom",
)


def _check_inputs(
    spec: ModelSpec,
    *,
    context: int,
    batch: int,
    kv_dtype: str,
    weights: str,
    headroom: float,
    gpu_memory_utilization: float,
    block_size: int,
    max_num_batched_tokens: int,
    rope_factor: float | None,
) -> None:
    if kv_dtype not in KV_DTYPES:
        raise InputError(
            f"unknown KV dtype {kv_dtype!r}; expected one of {', '.join(KV_DTYPES)}", field="--kv-dtype"
        )
    if weights not in WEIGHT_FORMATS:
        raise InputError(
            f"unknown weights format {weights!r}; expected one of {', '.join(WEIGHT_FORMATS)}",
            field="--weights",
        )
    if weights.startswith("mxfp4") and not spec.moe_layers:
        raise InputError(
            f"--weights {weights} converts routed experts, and this model has none", field="--weights"
        )
    if batch < 1:
        raise InputError(f"expected at least one sequence, got {batch}", field="--batch")
    if context < 1:
        raise InputError(f"expected a positive context length, got {context}", field="--context")
    if rope_factor is not None and rope_factor <= 0:
        raise InputError(f"expected a positive factor, got {rope_factor}", field="--rope-factor")
    limit = context_limit(spec, rope_factor)
    if context > limit:
        base = spec.rope.original_max_position or spec.max_position
        raise InputError(
            f"--context {context:,} exceeds the model's limit of {limit:,} tokens "
            f"(max_position_embeddings {spec.max_position:,})",
            field="--context",
            hint=f"lower --context, or extend the model with --rope-factor "
            f"{math.ceil(context / base)} (rope scaling of the {base:,}-token base)",
        )
    if not 0 <= headroom < 1:
        raise InputError(f"expected a fraction in [0, 1), got {headroom}", field="--headroom")
    if not 0 < gpu_memory_utilization <= 1:
        raise InputError(
            f"expected a fraction in (0, 1], got {gpu_memory_utilization}", field="--gpu-memory-utilization"
        )
    if block_size < 1 or block_size & (block_size - 1):
        raise InputError(f"expected a power of two, got {block_size}", field="--block-size")
    if max_num_batched_tokens < 1:
        raise InputError(
            f"expected a positive token count, got {max_num_batched_tokens}", field="--max-num-batched-tokens"
        )


def _check_images(spec: ModelSpec, images: int, image_size: tuple[int, int], context: int,
                  rope_factor: float | None) -> int:
    """Image tokens per request; InputError for images on a text-only model, a bad size, or
    text plus image tokens beyond the model's context limit."""
    if images < 0:
        raise InputError(f"expected 0 or more images per request, got {images}", field="--images")
    if not images:
        return 0
    if spec.vision is None:
        raise InputError(f"{spec.model_type} has no vision tower; it takes no images", field="--images",
                         hint="drop --images, or plan a multimodal model (kimi_k25, llama4)")
    if len(image_size) != 2 or min(image_size) < 1:
        raise InputError(f"expected HEIGHTxWIDTH in pixels, got {image_size}", field="--image-size")
    tokens = image_tokens_per_request(spec, images, image_size)
    limit = context_limit(spec, rope_factor)
    if context + tokens > limit:
        raise InputError(f"--context {context:,} plus {tokens:,} image tokens exceeds the model's limit of "
                         f"{limit:,} tokens", field="--context", hint="lower --context or --images")
    return tokens


def checkpoint_component_bytes(checkpoint, weights: str) -> dict[str, int] | None:
    """The checkpoint's exact bytes per component when the weights are used as stored, else None.

    checkpoint: an adapt.model.checkpoint.Checkpoint, its ``bytes_by_component()`` dict, or None.
    """
    if checkpoint is None or weights != "as-stored":
        return None
    return checkpoint if isinstance(checkpoint, dict) else checkpoint.bytes_by_component()


def plan_memory(
    spec: ModelSpec,
    target: Target,
    *,
    devices: int,
    nodes: int = 1,
    context: int,
    batch: int,
    kv_dtype: str = "bf16",
    weights: str = "as-stored",
    tp: int | None = None,
    ep: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    dcp: int | None = None,
    headroom: float = 0.2,
    checkpoint=None,
    max_num_batched_tokens: int | None = None,
    gpu_memory_utilization: float | None = None,
    block_size: int = 64,
    max_num_seqs: int | None = None,
    rope_factor: float | None = None,
    layout: Layout | None = None,
    search: bool = True,
    images: int = 0,
    image_size: tuple[int, int] = (1024, 1024),
) -> MemoryPlan:
    """Bytes per device for ``batch`` sequences of ``context`` tokens on ``devices`` devices.

    devices: total devices over ``nodes`` nodes; tp/ep/pp/dp/dcp: the layout (unset: TP over
        each node's devices, PP over nodes, no EP, no DCP; ``layout`` overrides them)
    checkpoint: an adapt.model.checkpoint.Checkpoint (or its ``bytes_by_component()`` dict);
        with weights "as-stored" its exact per-component bytes replace the spec's
    max_num_batched_tokens / max_num_seqs: vLLM's (unset: the defaults `vllm serve` picks on
        this target); gpu_memory_utilization: unset -> vLLM's 0.9
    headroom: margin added to every estimated term, as a fraction of their sum
    search: also compute fewest devices, longest context and the smallest utilization that fits
    images, image_size: images of (height, width) pixels per request: their tokens join every
        sequence's KV and the vision encoder's activation peak joins the activations
    """
    default_tokens, default_seqs = vllm_batch_defaults(target)
    max_num_batched_tokens = max_num_batched_tokens or default_tokens
    max_num_seqs = max_num_seqs or default_seqs
    util = VLLM_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    _check_inputs(
        spec,
        context=context,
        batch=batch,
        kv_dtype=kv_dtype,
        weights=weights,
        headroom=headroom,
        gpu_memory_utilization=util,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        rope_factor=rope_factor,
    )
    image_tokens = _check_images(spec, images, image_size, context, rope_factor)
    if layout is None:
        layout = resolve_layout(
            spec, target, devices=devices, nodes=nodes, tp=tp, ep=ep, pp=pp, dp=dp, weights=weights, dcp=dcp
        )
    checkpoint_bytes = checkpoint_component_bytes(checkpoint, weights)
    options = dict(
        weights=weights,
        kv_dtype=kv_dtype,
        block_size=block_size,
        headroom=headroom,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        image_tokens=image_tokens,
        vision_activation=vision_activation_bytes(spec, images, image_size),
    )
    sequences = -(-batch // layout.dp)
    budget = int(util * target.memory_bytes)
    stage, rule = _evaluate(
        spec,
        target,
        layout,
        context=context,
        sequences=sequences,
        budget=budget,
        checkpoint_bytes=checkpoint_bytes,
        **options,
    )
    terms = {k: int(round(v)) for k, v in stage.terms.items()}
    rule = assess(terms, budget_bytes=budget, kv_bytes_per_sequence=stage.kv_per_sequence,
                  requested_sequences=sequences)
    pool, concurrent, verdict = rule.pool_bytes, rule.concurrent_sequences, rule.verdict
    terms["kv_cache"] = sequences * stage.kv_per_sequence
    binding = max(terms, key=lambda k: terms[k])
    plan = MemoryPlan(
        model=spec.source,
        target=target.name,
        layout=layout,
        nodes=nodes,
        context=context,
        batch=batch,
        kv_dtype=kv_dtype,
        weights_format=weights,
        weights_source="checkpoint headers" if checkpoint_bytes is not None else "model spec",
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=util,
        headroom=headroom,
        device_memory_bytes=target.memory_bytes,
        budget_bytes=budget,
        terms=terms,
        exact_terms=EXACT_TERMS,
        estimated_terms=ESTIMATED_TERMS,
        weights_by_component={k: int(round(v)) for k, v in stage.weights_by_component.items()},
        activation_detail=stage.activation_detail,
        kv_bytes_per_token=stage.kv_per_token,
        kv_bytes_per_sequence=stage.kv_per_sequence,
        kv_pool_bytes=int(pool),
        sequences_per_replica=sequences,
        concurrent_sequences=concurrent,
        verdict=verdict,
        binding_term=binding,
        binding_stage=stage.stage,
        fewest_devices=None,
        longest_context=0,
        min_gpu_memory_utilization=None,
        images=images,
        image_size=tuple(image_size),
        image_tokens_per_request=image_tokens,
        recurrent_state_bytes_per_sequence=recurrent_state_bytes(spec, layout, stage.layers),
    )
    if weights == "mxfp4-online":
        plan.mxfp4_comparison = _mxfp4_comparison(spec, target, layout, stage, checkpoint_bytes, options)
    plan.min_gpu_memory_utilization = _min_utilization(terms, target)
    if search:
        plan.longest_context = _longest_context(
            spec,
            target,
            layout,
            budget,
            sequences,
            checkpoint_bytes,
            context_limit(spec, rope_factor) - image_tokens,
            options,
        )
        plan.fewest_devices = _fewest_devices(spec, target, context, batch, checkpoint_bytes, util, options)
    plan.explanation = _explain(plan)
    return plan


def _evaluate(
    spec: ModelSpec,
    target: Target,
    layout: Layout,
    *,
    context: int,
    sequences: int,
    budget: int,
    checkpoint_bytes,
    weights: str,
    kv_dtype: str,
    block_size: int,
    headroom: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    image_tokens: int = 0,
    vision_activation: int = 0,
) -> tuple[_StageResult, Headroom]:
    """The binding pipeline stage (fewest concurrent sequences) and the headroom rule's answer for it."""
    worst: tuple[_StageResult, int, float] | None = None
    decode_tokens = min(sequences, max_num_seqs, max_num_batched_tokens)
    for stage, layers in enumerate(pp_stages(spec.num_layers, layout.pp)):
        result = _stage_terms(
            spec,
            target,
            layout,
            stage=stage,
            layers=layers,
            weights=weights,
            kv_dtype=kv_dtype,
            context=context,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            headroom=headroom,
            decode_tokens=decode_tokens,
            checkpoint_bytes=checkpoint_bytes,
            image_tokens=image_tokens,
            vision_activation=vision_activation,
        )
        rule = assess(result.terms, budget_bytes=budget, kv_bytes_per_sequence=result.kv_per_sequence,
                      requested_sequences=sequences)
        if worst is None or (rule.concurrent_sequences, rule.pool_bytes) < (
                worst[1].concurrent_sequences, worst[1].pool_bytes):
            worst = (result, rule)
    assert worst is not None
    return worst


def _longest_context(spec, target, layout, budget, sequences, checkpoint_bytes, limit, options) -> int:
    """Longest context (tokens, a multiple of the block size or the model limit) at which
    ``sequences`` sequences fit per replica; 0 when none does."""
    block = options["block_size"]

    def fits(tokens: int) -> bool:
        _, rule = _evaluate(
            spec,
            target,
            layout,
            context=tokens,
            sequences=sequences,
            budget=budget,
            checkpoint_bytes=checkpoint_bytes,
            **options,
        )
        return rule.passes

    if fits(limit):
        return limit
    lo, hi = 0, limit // block
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * block):
            lo = mid
        else:
            hi = mid - 1
    return lo * block


def _min_utilization(terms: dict[str, int], target: Target) -> float | None:
    """Smallest gpu_memory_utilization (two decimals) whose budget covers every term."""
    need = sum(terms.values()) / target.memory_bytes
    value = math.ceil(need * 100) / 100
    return value if value <= 0.99 else None


def _fewest_devices(spec, target, context, batch, checkpoint_bytes, util, options) -> int | None:
    """The fewest devices (TP inside a node, PP over nodes) that fit ``batch`` sequences of ``context``."""
    per_node = target.devices_per_node
    counts = [d for d in divisors(per_node)] + [per_node * n for n in range(2, target.max_nodes + 1)]
    budget = int(util * target.memory_bytes)
    for count in counts:
        nodes = max(1, count // per_node)
        layout = Layout(tp=min(count, per_node), pp=nodes)
        if layout_problems(spec, layout, options["weights"]):
            continue
        _, rule = _evaluate(
            spec,
            target,
            layout,
            context=context,
            sequences=batch,
            budget=budget,
            checkpoint_bytes=checkpoint_bytes,
            **options,
        )
        if rule.passes:
            return count
    return None


def _mxfp4_comparison(spec, target, layout, stage: _StageResult, checkpoint_bytes, options) -> dict[str, int]:
    """Online MXFP4 experts + FP8 workspace beside an offline FP8 copy of the experts (one device)."""
    offline = _stage_weights(spec, layout, "mxfp4-offline-fp8", stage.stage, stage.layers, target, None)
    return {
        "online_expert_bytes": int(stage.weights_by_component.get("routed_experts", 0)),
        "online_fp8_workspace_bytes": int(stage.terms["mxfp4_fp8_workspace"]),
        "offline_fp8_expert_bytes": int(offline.expert_bytes),
    }


def gib_text(value: float) -> str:
    """Bytes as GiB text with two decimals ("1,234.56 GiB")."""
    return f"{value / GiB:,.2f} GiB"


def _explain(plan: MemoryPlan) -> list[str]:
    t = plan.terms
    buffer_terms = ("moe_dispatch_buffers", "communication_buffers", "cuda_graphs", "framework_overhead")
    buffers = sum(t[k] for k in buffer_terms)
    lines = [
        f"{plan.layout.label()} on {plan.layout.devices} x {plan.target}: budget "
        f"{plan.gpu_memory_utilization:.2f} x {gib_text(plan.device_memory_bytes)} = {gib_text(plan.budget_bytes)} "
        "per device.",
        f"Weights {gib_text(t['weights'])} per device ({plan.weights_format}, from {plan.weights_source})"
        + (
            f" + {gib_text(t['weight_layout_padding'])} MXFP4 kernel-layout padding"
            if t["weight_layout_padding"]
            else ""
        )
        + ".",
        f"Estimated: activations {gib_text(t['activations'])} (prefill chunk of {plan.max_num_batched_tokens:,} "
        f"tokens, sampler over {min(plan.max_num_seqs, plan.max_num_batched_tokens):,} requests), "
        f"buffers and overhead {gib_text(buffers)},"
        f" headroom {gib_text(t['headroom'])} ({plan.headroom:.0%} of the estimates).",
        f"KV cache pool {gib_text(plan.kv_pool_bytes)}; one sequence of {plan.context:,} tokens needs "
        f"{gib_text(plan.kv_bytes_per_sequence)}; {plan.concurrent_sequences:,} fit per replica, "
        f"{plan.sequences_per_replica:,} requested.",
    ]
    if plan.image_tokens_per_request:
        lines.append(
            f"{plan.images} image(s) of {plan.image_size[0]}x{plan.image_size[1]} px add "
            f"{plan.image_tokens_per_request:,} tokens to every sequence's KV; the vision encoder's peak is "
            f"{gib_text(plan.activation_detail.get('vision_encoder', 0))}.")
    if plan.recurrent_state_bytes_per_sequence:
        lines.append(
            f"Linear-attention state: {gib_text(plan.recurrent_state_bytes_per_sequence)} per sequence, constant in "
            "its length, held beside the growing KV (vLLM's hybrid KV cache).")
    if plan.verdict == "does-not-fit":
        lines.append(
            f"Does not fit: vLLM would refuse to start (KV for one {plan.context:,}-token sequence "
            f"exceeds the pool); binding term: {plan.binding_term} ({gib_text(t[plan.binding_term])})."
        )
    elif plan.verdict == "fits-fewer-sequences":
        lines.append(
            f"Starts, but only {plan.concurrent_sequences:,} of {plan.sequences_per_replica:,} sequences "
            f"fit at once; binding term: {plan.binding_term} ({gib_text(t[plan.binding_term])})."
        )
    else:
        lines.append(f"Fits; the largest term is {plan.binding_term} ({gib_text(t[plan.binding_term])}).")
    if (
        plan.min_gpu_memory_utilization is not None
        and plan.min_gpu_memory_utilization > plan.gpu_memory_utilization
    ):
        lines.append(f"Fits with --gpu-memory-utilization {plan.min_gpu_memory_utilization:.2f} or more.")
    return lines


# ---------------------------------------------------------------------------------------
# What stage 2 and preflight read off a finished plan


def plan_headroom(plan: MemoryPlan) -> Headroom:
    """The headroom rule applied to a finished plan (its binding device)."""
    return assess({k: v for k, v in plan.terms.items() if k != "kv_cache"}, budget_bytes=plan.budget_bytes,
                  kv_bytes_per_sequence=plan.kv_bytes_per_sequence,
                  requested_sequences=plan.sequences_per_replica)


def load_model(model: str) -> tuple[ModelSpec, Any]:
    """ModelSpec and, for a directory with safetensors headers, its Checkpoint (else None)."""
    from adapt.model.checkpoint import Checkpoint
    from adapt.model.spec import load_spec

    spec = load_spec(model)
    path = Path(model)
    checkpoint = None
    if path.is_dir() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()
    ):
        checkpoint = Checkpoint.open(path)
    return spec, checkpoint
