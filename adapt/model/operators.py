"""The semantic operators a ModelSpec implies: the names a bring-up engineer reasons about
(routing variants, norms, RoPE variants, attention kinds, the DSA indexer, MoE permute and grouped
GEMM, activations, linear layers by storage format, quantization operators, paged caches).
Stage 1 lifts a trace onto these names; stage 3 takes the operators it must test from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from adapt.model.spec import ModelSpec

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")

# Semantic operator -> category shown in the "kind" column.
OP_KINDS = {
    "embedding": "embedding",
    "linear_bf16": "linear",
    "linear_fp8_block": "linear",
    "linear_int4": "linear",
    "rmsnorm": "norm",
    "layernorm": "norm",
    "rope_plain": "rope",
    "rope_yarn": "rope",
    "rope_llama3": "rope",
    "rope_linear": "rope",
    "rope_dynamic": "rope",
    "rope_longrope": "rope",
    "attention_gqa": "attention",
    "attention_gqa_sinks": "attention",
    "attention_sliding_window": "attention",
    "attention_sliding_window_sinks": "attention",
    "attention_mla": "attention",
    "attention_mla_sparse": "attention",
    "dsa_indexer": "attention",
    "kv_cache_paged": "kv cache",
    "kv_cache_mla_latent": "kv cache",
    "kv_cache_indexer": "kv cache",
    "routing_softmax_topk": "routing",
    "routing_topk_softmax": "routing",
    "routing_sigmoid_topk": "routing",
    "routing_sigmoid_group_topk": "routing",
    "moe_permute": "moe",
    "moe_grouped_gemm_bf16": "moe",
    "moe_grouped_gemm_fp8_block": "moe",
    "moe_grouped_gemm_mxfp4": "moe",
    "moe_grouped_gemm_int4": "moe",
    "swiglu": "activation",
    "swiglu_clamped": "activation",
    "fp8_block_dequant": "quantization",
    "fp8_act_quant": "quantization",
    "mxfp4_decode": "quantization",
    "int4_dequant": "quantization",
    # multimodal, hybrid linear attention and NVFP4 (issue 18)
    "linear_nvfp4": "linear",
    "moe_grouped_gemm_nvfp4": "moe",
    "nvfp4_decode": "quantization",
    "l2norm_qk": "norm",
    "rmsnorm_gated": "norm",
    "attention_chunked": "attention",
    "attention_output_gate": "attention",
    "causal_conv1d_prefill": "linear attention",
    "causal_conv1d_update": "linear attention",
    "gated_delta_rule_chunked": "linear attention",
    "gated_delta_rule_recurrent": "linear attention",
    "recurrent_state_cache": "kv cache",
    "routing_topk_sigmoid": "routing",
    "patch_embedding": "vision",
    "rope_2d_vision": "rope",
    "attention_vision": "attention",
    "gelu": "activation",
    "patch_merge": "vision",
}
FUSIONS = {
    "fuse_qkv_projection": "projections reading the same input merged into one GEMM",
    "fuse_gate_up_projection": "gate and up projections merged into one GEMM",
    "fuse_mask_softmax": "mask add folded into the attention softmax (flash-style kernel)",
    "fuse_routing_permute": "top-k routing fused with the token permutation by expert",
    "fuse_dequant_matmul": "weight dequantization inside the GEMM (no dequantized copy)",
    "fuse_residual_rmsnorm": "residual add fused with the following RMSNorm",
}
ROPE_NAMES = {
    "default": "rope_plain",
    "yarn": "rope_yarn",
    "llama3": "rope_llama3",
    "linear": "rope_linear",
    "dynamic": "rope_dynamic",
    "longrope": "rope_longrope",
}
FORMAT_SUFFIX = {
    "bf16": "bf16",
    "fp16": "bf16",
    "fp32": "bf16",
    "fp8_block": "fp8_block",
    "mxfp4": "mxfp4",
    "int4": "int4",
    "nvfp4": "nvfp4",
}


@dataclass
class SemanticOp:
    """One operator as a bring-up engineer names it.

    name: the stack-table key ("dsa_indexer", "rope_yarn", ...); kind: category (OP_KINDS)
    details: variants and sizes seen ("interleaved pairs at self_attn", "top-8 of 256", ...)
    layers: decoder layer indices that run it (empty: model-level, e.g. embeddings)
    count: executions per forward step (one prefill or one decode step), all layers
    origin: "trace" | "spec" | "spec (quantization_config)"; modules: module paths ("layers.*")
    aten: aten operators it was lifted from (trace only)
    """

    name: str
    kind: str
    details: list[str] = field(default_factory=list)
    layers: set[int] = field(default_factory=set)
    count: int = 0
    origin: str = "trace"
    modules: set[str] = field(default_factory=set)
    aten: set[str] = field(default_factory=set)

    @property
    def detail(self) -> str:
        return "; ".join(self.details)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "detail": self.detail,
            "layers": sorted(self.layers),
            "count": self.count,
            "origin": self.origin,
            "modules": sorted(self.modules),
            "aten": sorted(self.aten),
        }


class OpSet:
    """Accumulates SemanticOps by name; details, layers, modules and aten ops merge."""

    def __init__(self):
        self.ops: dict[str, SemanticOp] = {}

    def add(
        self,
        name: str,
        detail: str = "",
        layers=(),
        count: int = 1,
        origin: str = "trace",
        module: str = "",
        aten=(),
    ) -> SemanticOp:
        op = self.ops.get(name)
        if op is None:
            op = self.ops[name] = SemanticOp(name=name, kind=OP_KINDS.get(name, "other"), origin=origin)
        if detail and detail not in op.details:
            op.details.append(detail)
        op.layers.update(layers)
        op.count += count
        if module:
            op.modules.add(LAYER_RE.sub(lambda m: m.group(0).replace(m.group(1), "*"), module))
        op.aten.update(aten)
        return op

    def values(self) -> list[SemanticOp]:
        return list(self.ops.values())


def module_formats(spec: ModelSpec) -> dict[str, tuple[str, str]]:
    """Module path -> (component, storage method) of its weight matrices, from the spec's tensors."""
    out: dict[str, tuple[str, str]] = {}
    for tensor in spec.tensors(include_mtp=False):
        if not tensor.quantizable:
            continue
        module = tensor.name.rsplit(".", 1)[0]
        if ".experts." in module:
            module = module.split(".experts.")[0] + ".experts"
        out[module] = (tensor.component, spec.tensor_format(tensor).method)
    return out


def format_detail(spec: ModelSpec, component: str) -> str:
    fmt = spec.quant.format_of(component)
    if fmt.method == "fp8_block":
        rows, cols = fmt.block_size or (0, 0)
        return f"e4m3, {rows}x{cols} blocks, {fmt.scale_format} scales"
    if fmt.method == "mxfp4":
        return "E2M1 values, one E8M0 scale per 32"
    if fmt.method == "int4":
        return f"int4 groups of {(fmt.block_size or (1, 0))[1]}, {fmt.scale_format} scales"
    return fmt.method


def rope_detail(spec: ModelSpec, interleaved: bool, rotary_dim: int, head_dim: int, site: str) -> str:
    rope = spec.rope
    parts = ["interleaved pairs" if interleaved else "half-split (NeoX)"]
    if rope.factor:
        parts.append(f"factor {rope.factor:g} over {rope.original_max_position} tokens")
    if rotary_dim and head_dim and rotary_dim < head_dim:
        parts.append(f"partial: {rotary_dim} of {head_dim} dims")
    return f"{site}: " + ", ".join(parts)


def routing_name(scoring: str, n_group: int, softmax_after_topk: bool) -> str:
    if scoring == "sigmoid":
        return "routing_sigmoid_group_topk" if n_group > 1 else "routing_sigmoid_topk"
    return "routing_topk_softmax" if softmax_after_topk else "routing_softmax_topk"


def routing_detail(ffn) -> str:
    parts = [f"{ffn.scoring}", f"top-{ffn.top_k} of {ffn.num_experts}"]
    if ffn.correction_bias:
        parts.insert(1, "+ correction bias")
    if ffn.n_group > 1:
        parts.append(f"{ffn.n_group} groups -> best {ffn.topk_group}")
    if ffn.norm_topk_prob:
        parts.append("renormalized")
    if ffn.routed_scaling != 1.0:
        parts.append(f"x{ffn.routed_scaling:g}")
    return ", ".join(parts)


def first_moe(spec: ModelSpec):
    return spec.moe_layers[0].ffn if spec.moe_layers else None


def quant_sites(spec: ModelSpec) -> dict[str, tuple[set[int], int, set[str]]]:
    """Storage method -> (layers, quantized matrices per forward step, components) for quantized formats."""
    out: dict[str, tuple[set[int], int, set[str]]] = {}
    for tensor in spec.tensors(include_mtp=False):
        fmt = spec.tensor_format(tensor)
        if not tensor.quantizable or not fmt.quantized:
            continue
        layers, count, components = out.setdefault(fmt.method, (set(), 0, set()))
        if tensor.layer is not None:
            layers.add(tensor.layer)
        components.add(tensor.component)
        out[fmt.method] = (layers, count + 1, components)
    return out


def add_quant_ops(ops: OpSet, spec: ModelSpec, fusions: dict[str, dict[str, Any]]) -> None:
    origin = f"spec (quantization_config {spec.quant.source})"
    for method, (layers, count, components) in quant_sites(spec).items():
        component = sorted(components)[0]
        where = ", ".join(sorted(components))
        if method == "fp8_block":
            ops.add("fp8_block_dequant", f"{format_detail(spec, component)}: {where}", layers, count, origin)
            ops.add(
                "fp8_act_quant",
                "dynamic per-token groups of 128 to e4m3 before each fp8 GEMM",
                layers,
                count,
                origin,
            )
        elif method == "mxfp4":
            ops.add("mxfp4_decode", f"{format_detail(spec, component)}: {where}", layers, count, origin)
        elif method == "int4":
            ops.add("int4_dequant", f"{format_detail(spec, component)}: {where}", layers, count, origin)
        elif method == "nvfp4":
            ops.add("nvfp4_decode", f"{format_detail(spec, component)}: {where}", layers, count, origin)
        fusions.setdefault(
            "fuse_dequant_matmul",
            {
                "candidate": "fuse_dequant_matmul",
                "what": FUSIONS["fuse_dequant_matmul"],
                "where": set(),
                "layers": set(),
                "count": 0,
                "evidence": "",
            },
        )
        row = fusions["fuse_dequant_matmul"]
        row["where"].add(f"{method}: {where}")
        row["layers"].update(layers)
        row["count"] += count
        row["evidence"] = "quantized weights (spec)"


def fusion_rows(fusions: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for row in fusions.values():
        rows.append({**row, "where": ", ".join(sorted(row["where"])), "layers": sorted(row["layers"])})
    return rows


def ops_from_spec(spec: ModelSpec) -> tuple[list[SemanticOp], list[dict[str, Any]]]:
    """The semantic operators the ModelSpec implies, without a trace (counts per forward step)."""
    ops = OpSet()
    rope = ROPE_NAMES.get(spec.rope.type, f"rope_{spec.rope.type}")
    fusions: dict[str, dict[str, Any]] = {}
    add = lambda name, detail, layers, count=1: ops.add(name, detail, layers, count, "spec")  # noqa: E731
    add("embedding", f"vocab {spec.vocab:,}", ())
    add("rmsnorm", f"hidden ({spec.hidden})", (), 1)
    add(f"linear_{FORMAT_SUFFIX[spec.quant.format_of('lm_head').method]}", "lm_head", ())
    for layer in spec.layers:
        at, ffn, here = layer.attention, layer.ffn, (layer.index,)
        add("rmsnorm", f"hidden ({spec.hidden})", here, 2)
        attn_fmt = FORMAT_SUFFIX[spec.quant.format_of("attention").method]
        if at.kind == "linear":
            _add_linear_attention_ops(add, spec, at, here)
        elif at.kind in ("mla", "mla+dsa"):
            add("rmsnorm", f"MLA kv latent ({at.kv_lora_rank})", here)
            if at.q_lora_rank:
                add("rmsnorm", f"MLA q latent ({at.q_lora_rank})", here)
            add(f"linear_{attn_fmt}", "attention", here, 5 if at.q_lora_rank else 4)
            name = "attention_mla_sparse" if at.kind == "mla+dsa" else "attention_mla"
            detail = f"{at.num_heads} heads, latent {at.kv_lora_rank} + rope {at.qk_rope_head_dim}"
            if at.kind == "mla+dsa":
                detail += f", attends to the indexer's top-{at.index_topk} tokens"
            add(name, detail, here)
            add(
                "kv_cache_mla_latent",
                f"{at.kv_lora_rank} latent + {at.qk_rope_head_dim} rope values per token",
                here,
            )
            add(
                rope,
                rope_detail(spec, spec.rope.interleaved, at.qk_rope_head_dim, at.head_dim, "attention"),
                here,
            )
        else:
            add(f"linear_{attn_fmt}", "attention", here, 4)
            if at.kind == "chunked":
                base = "attention_chunked"
            else:
                base = "attention_sliding_window" if at.window else "attention_gqa"
            detail = (
                f"{'GQA' if at.num_kv_heads < at.num_heads else 'MHA'} "
                f"{at.num_heads}/{at.num_kv_heads} heads, "
                f"head dim {at.head_dim}"
                + (f", chunks of {at.chunk}" if at.chunk else f", window {at.window}" if at.window else "")
                + (", learned sinks" if at.sinks else "")
                + ("" if at.rope else ", NoPE (no rotary)")
            )
            add(base + ("_sinks" if at.sinks else ""), detail, here)
            _add_attention_extras(add, at, here)
            add(
                "kv_cache_paged",
                f"K and V, {at.num_kv_heads} heads x {at.head_dim}"
                + (f", window {at.window}" if at.window else ""),
                here,
            )
            if at.rope:
                add(
                    rope,
                    rope_detail(spec, spec.rope.interleaved, spec.rope.rotary_dim, at.head_dim, "attention"),
                    here,
                )
            if at.qk_norm:
                add("rmsnorm", f"per-head q norm ({at.head_dim})", here)
                add("rmsnorm", f"per-head k norm ({at.head_dim})", here)
        if at.kind == "mla+dsa":
            add("dsa_indexer", f"{at.index_n_heads} heads x {at.index_head_dim}, top-{at.index_topk}", here)
            add("layernorm", f"k_norm ({at.index_head_dim})", here)
            add(f"linear_{FORMAT_SUFFIX[spec.quant.format_of('indexer').method]}", "indexer", here, 2)
            add("linear_bf16", "indexer", here)
            add(rope, rope_detail(spec, False, at.qk_rope_head_dim, at.index_head_dim, "indexer"), here)
            add("kv_cache_indexer", f"{at.index_head_dim} key values per token", here)
        if ffn.kind == "dense":
            add(f"linear_{FORMAT_SUFFIX[spec.quant.format_of('dense_mlp').method]}", "dense_mlp", here, 3)
            add("swiglu", "silu(gate) * up", here)
            continue
        routing = "routing_topk_sigmoid" if ffn.score_after_topk else routing_name(
            ffn.scoring, ffn.n_group, spec.model_type == "gpt_oss")
        add(routing, routing_detail(ffn), here)
        add("moe_permute", "sort token-expert pairs by expert, gather rows, weighted un-permute", here)
        method = FORMAT_SUFFIX[spec.quant.format_of("routed_experts").method]
        add(
            f"moe_grouped_gemm_{method}",
            f"{ffn.num_experts} experts x {ffn.expert_intermediate}, "
            f"{format_detail(spec, 'routed_experts')}",
            here,
        )
        if ffn.activation == "swiglu_clamped":
            add("swiglu_clamped", f"clamp {ffn.swiglu_limit}, sigmoid(alpha * gate), (up + 1)", here)
        else:
            add("swiglu", "silu(gate) * up", here)
        if ffn.num_shared_experts:
            add(
                f"linear_{FORMAT_SUFFIX[spec.quant.format_of('shared_experts').method]}",
                "shared_experts",
                here,
                3,
            )
            add("swiglu", "silu(gate) * up", here)
            if ffn.shared_gate:
                add("linear_bf16", "shared expert gate [1, hidden], sigmoid", here)
    if spec.vision is not None:
        _add_vision_ops(add, spec)
    add_quant_ops(ops, spec, fusions)
    return ops.values(), fusion_rows(fusions)


def _add_attention_extras(add, at, here) -> None:
    """Llama 4's parameter-free q/k L2 norm and Qwen3-Next's sigmoid output gate."""
    if at.qk_l2norm:
        add("l2norm_qk", f"q and k per head ({at.head_dim}), no weight", here, 2)
    if at.output_gate:
        add("attention_output_gate", f"sigmoid(gate) x output, {at.num_heads} heads x {at.head_dim}", here)


def _add_linear_attention_ops(add, spec: ModelSpec, at, here) -> None:
    """Gated DeltaNet (Qwen3-Next linear_attn): projections, causal conv (prefill over the
    prompt, update per decode token), the gated delta rule (chunked in prefill, recurrent in
    decode), the gated RMSNorm, and the per-sequence state it keeps."""
    fmt = FORMAT_SUFFIX[spec.quant.format_of("linear_attention").method]
    key_dim = at.linear_key_heads * at.linear_key_dim
    value_dim = at.linear_value_heads * at.linear_value_dim
    conv_dim = 2 * key_dim + value_dim
    add(f"linear_{fmt}", "linear_attention: in_proj_qkvz, in_proj_ba, out_proj", here, 3)
    add("causal_conv1d_prefill", f"depthwise, width {at.conv_kernel}, {conv_dim} channels, prefill", here)
    add("causal_conv1d_update", f"one token against {at.conv_kernel - 1} cached inputs, decode", here)
    heads = (f"{at.linear_value_heads} value heads ({at.linear_key_heads} key heads) x "
             f"{at.linear_key_dim}x{at.linear_value_dim}")
    add("gated_delta_rule_chunked", f"{heads}, decay exp(-softplus) gating, chunked in prefill", here)
    add("gated_delta_rule_recurrent", f"{heads}, one state update per token in decode", here)
    add("l2norm_qk", f"q and k per head ({at.linear_key_dim}), no weight", here, 2)
    add("rmsnorm_gated", f"value heads ({at.linear_value_dim}) times silu(z)", here)
    add("recurrent_state_cache",
        f"per sequence: conv state {conv_dim} x {at.conv_kernel - 1}, recurrent state "
        f"{at.linear_value_heads} x {at.linear_key_dim} x {at.linear_value_dim}", here)


def _add_vision_ops(add, spec: ModelSpec) -> None:
    """The vision tower and projector: patch embedding, bidirectional variable-length attention
    per image, 2D RoPE, LayerNorm + GELU MLP blocks, the patch merge and the projector GEMMs.
    Counts are per image (per tile for Llama 4) through the whole tower."""
    v = spec.vision
    fmt = FORMAT_SUFFIX[spec.quant.format_of("vision").method]
    proj_fmt = FORMAT_SUFFIX[spec.quant.format_of("projector").method]
    head_dim = v.hidden // v.heads
    add("patch_embedding", f"{v.patch_size}x{v.patch_size}x{v.channels} patches -> {v.hidden}", ())
    add("attention_vision",
        f"bidirectional, variable length per image, {v.heads} heads x {head_dim}"
        + (", one 336-pixel tile per sequence" if v.kind == "llama4" else ", native resolution"), (), v.layers)
    add("rope_2d_vision", f"patch row and column, head dim {head_dim}", (), v.layers)
    add("layernorm", f"vision ({v.hidden})", (), 2 * v.layers + (2 if v.kind == "llama4" else 1))
    add(f"linear_{fmt}", "vision: qkv, o, MLP fc", (), 4 * v.layers)
    add("gelu", f"vision MLP ({v.intermediate})", (), v.layers)
    merge = "pixel shuffle" if v.kind == "llama4" else "merge + temporal mean"
    add("patch_merge", f"{v.merge[0]}x{v.merge[1]} patches -> one token ({merge})", ())
    add(f"linear_{proj_fmt}", "projector", (), 3 if v.kind == "llama4" else 2)
    add("gelu", "projector", (), 1)
