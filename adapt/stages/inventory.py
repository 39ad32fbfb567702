"""Stage 1: operator inventory and gap analysis.

The map every bring-up starts from: each operator the model needs, and for each whether the
target's software stack has it natively, can compose it, gets it from adapt's kernels, or lacks it.

How the list is made:

1. Trace. The model's transformers implementation is built on the meta device (shapes and
   dtypes, no storage: a trillion-parameter config costs no weight memory) at full width, and
   one prefill of ``prefill_tokens`` tokens plus one decode step run under a TorchDispatchMode
   that records every aten operator with its dtypes, first input shape and the module path it
   ran in (a forward pre/post hook stack). By default only one decoder layer of each distinct
   structure runs (e.g. the first dense and the first MoE layer of DeepSeek-V3.2); the other
   layers pass their input through untouched, and counts are scaled by how many layers share
   each structure (``all_layers=True`` traces every layer). Quantized checkpoints'
   ``quantization_config`` is dropped for the trace (transformers would load quantizers);
   experts run through transformers' ``grouped_mm`` path, which needs no data-dependent
   ``.nonzero()`` and so runs on meta tensors.
2. Lift. Aten operators are grouped into the semantic operators a bring-up engineer reasons
   about (``SemanticOp``): routing variants, norms, RoPE variants, attention kinds, the DSA
   indexer, MoE permute and grouped GEMM, activations, linear layers by storage format.
   Quantization operators (fp8 block dequant, MXFP4 decode, ...) come from the ModelSpec's
   QuantSpec, as do the paged caches, and each row says where it came from.
3. Fall back. When transformers cannot build or run the config, the operator list comes from
   the ModelSpec alone, and the report says so.
4. Classify each operator against the stack table (``adapt/targets/stacks/<stack>.yaml``):
   native, composable, adapt_kernel (the kernel must import, its test is named) or missing.
   A requirement the target lacks (``requires: [fp8]`` on a target without fp8) turns the entry
   into a gap with the reason and the stack's plan for closing it.

Gate (``gates.yaml`` ``inventory``): operators missing without a plan beyond ``max_missing``
fail; missing with a plan and composable operators warn.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from adapt.model.operators import (
    FORMAT_SUFFIX,
    FUSIONS,
    LAYER_RE,
    OP_KINDS,
    ROPE_NAMES,
    OpSet,
    SemanticOp,
    add_quant_ops,
    first_moe,
    format_detail,
    fusion_rows,
    module_formats,
    ops_from_spec,
    rope_detail,
    routing_detail,
    routing_name,
)
from adapt.model.spec import ModelSpec, load_spec
from adapt.report import StageReport, fingerprint, load_gates, now_iso
from adapt.targets.support import GapRow, classify, format_layers
from adapt.targets.target import load_stack, load_target

PREFILL_TOKENS = 16
_STRUCTURE_ATTRS = ("sliding_window", "attention_type", "is_sliding", "layer_type")
_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}

# ---------------------------------------------------------------- trace


class TraceUnavailable(Exception):
    """transformers cannot build or run this config on the meta device; the message says why."""


@dataclass
class AtenCall:
    """One aten operator at one module in one phase, aggregated over its calls.

    op: e.g. "aten.mm.default"; slices with a step > 1 read "aten.slice.Tensor[step=2]"
    module: the module's path in the full model ("model.layers.3.mlp.experts"; "" outside modules)
    phase: "prefill" | "decode"; calls: times it ran in that phase
    dtypes: dtypes of its tensor inputs; shape: the first tensor input's shape at its first call
    """

    op: str
    module: str
    module_class: str
    phase: str
    calls: int
    dtypes: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass
class ModuleFacts:
    """What the lifting reads from one module: class, simple attributes, parameter/buffer shapes."""

    path: str
    cls: str
    attrs: dict[str, Any]
    tensors: dict[str, tuple[int, ...]]
    children: dict[str, str]


@dataclass
class ModelTrace:
    """A meta-device trace of one prefill and one decode step.

    calls: aggregated aten calls; modules: facts of every module of the model
    module_calls: (phase, path) -> forward calls; sequences: path -> its own aten ops in prefill order
    shared_inputs: groups of Linear module paths that read the very same input tensor
    layer_groups: traced layer index -> every layer index of that structure (itself included)
    seconds: wall time of building the meta model and running it (s); import_seconds: importing
    torch and transformers before that (s, near 0 when already imported); peak_rss_bytes: the
    process's peak RSS after the trace; rss_growth_bytes: growth of that peak during the trace;
    meta_parameter_bytes: bytes the model's
    parameters would take if materialised in their dtypes (none are allocated)
    """

    calls: list[AtenCall]
    modules: dict[str, ModuleFacts]
    module_calls: dict[tuple[str, str], int]
    sequences: dict[str, list[str]]
    shared_inputs: list[tuple[str, ...]]
    layer_groups: dict[int, tuple[int, ...]]
    num_layers: int
    prefill_tokens: int
    seconds: float
    import_seconds: float
    peak_rss_bytes: int
    rss_growth_bytes: int
    meta_parameter_bytes: int
    transformers_version: str

    def layers_of(self, path: str) -> tuple[int, ...]:
        """Layer indices a module path stands for (empty for modules outside the decoder layers)."""
        match = LAYER_RE.search(path)
        if not match:
            return ()
        index = int(match.group(1))
        return self.layer_groups.get(index, (index,))

    def own_ops(self, path: str, phase: str = "prefill") -> set[str]:
        return {c.op for c in self.calls if c.module == path and c.phase == phase}


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _hf_config(config: dict):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise TraceUnavailable(f"transformers has no model_type {model_type!r}")
    values = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config", "auto_map")}
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # transformers raises many types for configs it rejects
        raise TraceUnavailable(f"transformers rejects the config: {type(exc).__name__}: {exc}") from None


def _decoder_layers(model) -> Any:
    """The ModuleList of decoder layers (the one named ``layers`` with the most entries)."""
    import torch.nn as nn

    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise TraceUnavailable("no decoder ModuleList named 'layers' in the transformers model")
    return best


def _layer_signature(layer, layer_type: str | None) -> tuple:
    """Structure of a decoder layer: its submodule classes and the attributes that change its math."""
    parts: list[tuple] = [("layer_type", layer_type)]
    for name, module in layer.named_modules():
        parts.append((name, type(module).__name__))
        for attr in _STRUCTURE_ATTRS:
            value = module.__dict__.get(attr)
            if isinstance(value, (int, str, bool)):
                parts.append((name, attr, value))
    return tuple(parts)


def _module_facts(path: str, module) -> ModuleFacts:
    attrs = {
        k: v
        for k, v in module.__dict__.items()
        if not k.startswith("_") and k != "training" and isinstance(v, (int, float, bool, str, type(None)))
    }
    tensors = {
        k: tuple(v.shape) for k, v in {**module._parameters, **module._buffers}.items() if v is not None
    }
    children = {k: type(v).__name__ for k, v in module._modules.items() if v is not None}
    return ModuleFacts(path=path, cls=type(module).__name__, attrs=attrs, tensors=tensors, children=children)


def _op_name(func, args) -> str:
    name = str(func)
    if name == "aten.slice.Tensor" and len(args) >= 5 and isinstance(args[4], int) and args[4] > 1:
        return f"{name}[step={args[4]}]"
    return name


def trace_model(
    config: dict, *, prefill_tokens: int = PREFILL_TOKENS, all_layers: bool = False
) -> ModelTrace:
    """Trace one prefill of ``prefill_tokens`` tokens and one decode step on the meta device.

    config: a config.json dict (quantization_config is ignored for the trace).
    Raises TraceUnavailable when transformers cannot build or run the model.
    """
    rss_before = _peak_rss_bytes()
    import_started = time.perf_counter()
    import torch
    import torch.nn as nn
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    import_seconds = started - import_started

    class PassThroughLayer(nn.Module):
        """Stands in for a decoder layer whose structure another traced layer already covers."""

        def forward(self, hidden_states, *args, **kwargs):
            return hidden_states

    hf_config = _hf_config(config)
    dtype = getattr(
        torch, _TORCH_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")), "bfloat16")
    )
    try:
        with torch.device("meta"), _quiet_transformers():
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=dtype, attn_implementation="eager", experts_implementation="grouped_mm"
            )
    except Exception as exc:  # any failure to build is reported, never raised to the user
        raise TraceUnavailable(
            f"transformers {transformers.__version__} cannot build "
            f"{config.get('model_type')!r}: {type(exc).__name__}: {exc}"
        ) from None
    model.eval()
    names = {module: name for name, module in model.named_modules()}
    facts = {name: _module_facts(name, module) for module, name in names.items()}
    meta_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    layers = _decoder_layers(model)
    layer_types = getattr(hf_config, "layer_types", None) or [None] * len(layers)
    groups: dict[tuple, list[int]] = {}
    for index, layer in enumerate(layers):
        groups.setdefault(_layer_signature(layer, layer_types[index]), []).append(index)
    layer_groups = {members[0]: tuple(members) for members in groups.values()}
    if all_layers:
        layer_groups = {index: (index,) for index in range(len(layers))}
    else:
        for index in range(len(layers)):
            if index not in layer_groups:
                layers[index] = PassThroughLayer()

    stack: list[str] = []
    module_calls: dict[tuple[str, str], int] = {}
    linear_readers: dict[int, list[str]] = {}
    keep_alive: list[Any] = []
    state = {"phase": "prefill"}

    def pre_hook(module, args):
        path = names.get(module, type(module).__name__)
        stack.append(path)
        key = (state["phase"], path)
        module_calls[key] = module_calls.get(key, 0) + 1
        if isinstance(module, nn.Linear) and args and state["phase"] == "prefill":
            keep_alive.append(args[0])
            linear_readers.setdefault(id(args[0]), []).append(path)

    def post_hook(module, args, output):
        stack.pop()

    aggregated: dict[tuple[str, str, str], list] = {}
    sequences: dict[str, list[str]] = {}

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            path = stack[-1] if stack else ""
            op = _op_name(func, args)
            key = (state["phase"], path, op)
            entry = aggregated.get(key)
            tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            if entry is None:
                entry = aggregated[key] = [0, set(), tuple(tensors[0].shape) if tensors else ()]
            entry[0] += 1
            entry[1].update(str(t.dtype).replace("torch.", "") for t in tensors)
            if state["phase"] == "prefill":
                sequences.setdefault(path, []).append(op)
            return func(*args, **kwargs)

    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook))
    ids = torch.zeros(1, prefill_tokens, dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), _quiet_transformers(), Recorder():
            out = model(input_ids=ids, use_cache=True)
            state["phase"] = "decode"
            model(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    except Exception as exc:  # a module that cannot run on meta: say which, fall back to the spec
        where = stack[-1] if stack else "the model"
        raise TraceUnavailable(
            f"the meta-device {state['phase']} failed in {where}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    finally:
        for handle in handles:
            handle.remove()

    classes = {path: f.cls for path, f in facts.items()}
    calls = [
        AtenCall(
            op=op,
            module=path,
            module_class=classes.get(path, ""),
            phase=phase,
            calls=entry[0],
            dtypes=tuple(sorted(entry[1])),
            shape=entry[2],
        )
        for (phase, path, op), entry in aggregated.items()
    ]
    shared = [tuple(paths) for paths in linear_readers.values() if len(paths) > 1]
    seconds = time.perf_counter() - started
    peak = _peak_rss_bytes()
    return ModelTrace(
        calls=calls,
        modules=facts,
        module_calls=module_calls,
        sequences=sequences,
        shared_inputs=shared,
        layer_groups=layer_groups,
        num_layers=len(layers),
        prefill_tokens=prefill_tokens,
        seconds=seconds,
        import_seconds=import_seconds,
        peak_rss_bytes=peak,
        rss_growth_bytes=max(0, peak - rss_before),
        meta_parameter_bytes=meta_bytes,
        transformers_version=transformers.__version__,
    )


def lift_trace(trace: ModelTrace, spec: ModelSpec) -> tuple[list[SemanticOp], list[dict[str, Any]]]:
    """Semantic operators and fusion candidates from a trace (quantization and caches from the spec)."""
    ops = OpSet()
    fusions: dict[str, dict[str, Any]] = {}
    formats = module_formats(spec)
    rotary = next(
        (f for p, f in trace.modules.items() if "rope_type" in f.attrs and "inv_freq" in f.tensors), None
    )
    rope_type = str(rotary.attrs["rope_type"]) if rotary else spec.rope.type
    rotary_dim = 2 * rotary.tensors["inv_freq"][0] if rotary else spec.rope.rotary_dim

    def fusion(name: str, where: str, layers, weight: int, evidence: str):
        row = fusions.setdefault(
            name,
            {
                "candidate": name,
                "what": FUSIONS[name],
                "where": set(),
                "layers": set(),
                "count": 0,
                "evidence": evidence,
            },
        )
        row["where"].add(LAYER_RE.sub(lambda m: m.group(0).replace(m.group(1), "*"), where))
        row["layers"].update(layers)
        row["count"] += weight

    for (phase, path), calls in sorted(trace.module_calls.items()):
        if phase != "prefill" or path not in trace.modules:
            continue
        facts = trace.modules[path]
        layers = trace.layers_of(path)
        weight = calls * max(1, len(layers))
        own = trace.own_ops(path)
        seq = trace.sequences.get(path, [])
        cls = facts.cls
        leaf = path.rsplit(".", 1)[-1]

        def add(name: str, detail: str = "", layers=layers, weight=weight, path=path, own=own) -> None:
            ops.add(name, detail, layers, weight, "trace", path, own)

        if "aten.embedding.default" in own:
            add("embedding", f"vocab {facts.tensors.get('weight', (0,))[0]:,}")
        elif cls.endswith("RMSNorm"):
            width = facts.tensors.get("weight", (0,))[0]
            site = {
                "q_norm": "per-head q norm",
                "k_norm": "per-head k norm",
                "q_a_layernorm": "MLA q latent",
                "kv_a_layernorm": "MLA kv latent",
            }.get(leaf, "hidden")
            add("rmsnorm", f"{site} ({width})")
        elif "aten.native_layer_norm.default" in own:
            add("layernorm", f"{leaf} ({facts.tensors.get('weight', (0,))[0]})")
        elif cls == "Linear":
            component, method = formats.get(path, ("", spec.quant.default.method))
            if not component and path.endswith("lm_head"):
                component = "lm_head"
            add(f"linear_{FORMAT_SUFFIX.get(method, method)}", component or leaf)
        elif "Router" in cls or (leaf == "gate" and "aten.topk.default" in own):
            ffn = next(
                (spec.layers[i].ffn for i in layers if spec.layers[i].ffn.kind == "moe"), first_moe(spec)
            )
            scoring = "sigmoid" if "aten.sigmoid.default" in own else "softmax"
            topks = [i for i, op in enumerate(seq) if op == "aten.topk.default"]
            softmaxes = [i for i, op in enumerate(seq) if op == "aten._softmax.default"]
            # the module's group count decides; GLM runs the group code path with one group. Without
            # the attribute, three top-k calls per routing (groups, best groups, experts) mean groups.
            n_group = facts.attrs.get("n_group", facts.attrs.get("num_group"))
            if not isinstance(n_group, int):
                n_group = 2 if len(topks) // max(1, calls) >= 3 else 1
            after = bool(topks and softmaxes and softmaxes[0] > topks[0])
            name = routing_name(scoring, n_group, after)
            add(name, routing_detail(ffn) if ffn else scoring)
        elif "Experts" in cls:
            ffn = next(
                (spec.layers[i].ffn for i in layers if spec.layers[i].ffn.kind == "moe"), first_moe(spec)
            )
            if own & {"aten.sort.default", "aten.index.Tensor"}:
                add("moe_permute", "sort token-expert pairs by expert, gather rows, weighted un-permute")
            if "aten._grouped_mm.default" in own or "aten.mm.default" in own:
                component, method = formats.get(path, ("routed_experts", spec.quant.default.method))
                size = f"{ffn.num_experts} experts x {ffn.expert_intermediate}" if ffn else ""
                add(
                    f"moe_grouped_gemm_{FORMAT_SUFFIX.get(method, method)}",
                    f"{size}, {format_detail(spec, 'routed_experts')}",
                )
                fusion("fuse_routing_permute", path, layers, weight, "router top-k feeds the expert sort")
            if "aten.clamp.default" in own:
                limit, alpha = facts.attrs.get("limit"), facts.attrs.get("alpha")
                add("swiglu_clamped", f"clamp {limit}, sigmoid(alpha {alpha} * gate), (up + 1)")
        elif leaf == "act_fn" and cls.endswith("Activation"):
            add("swiglu", f"{cls.replace('Activation', '').lower()}(gate) * up")
        elif "Indexer" in cls:
            verified = {"aten.relu.default", "aten.topk.default"} <= own
            add(
                "dsa_indexer",
                f"{facts.attrs.get('n_heads')} heads x {facts.attrs.get('head_dim')}, "
                f"top-{facts.attrs.get('index_topk')}"
                + ("" if verified else " (ReLU/top-k not seen in the trace)"),
            )
            interleaved = any(op.startswith("aten.slice.Tensor[step=") for op in own)
            ops.add(
                ROPE_NAMES.get(rope_type, f"rope_{rope_type}"),
                rope_detail(
                    spec,
                    interleaved,
                    facts.attrs.get("qk_rope_head_dim", 0),
                    facts.attrs.get("head_dim", 0),
                    "indexer",
                ),
                layers,
                weight,
                "trace",
                path,
            )
            ops.add(
                "kv_cache_indexer",
                f"{facts.attrs.get('head_dim')} key values per token",
                layers,
                weight,
                "spec",
                path,
            )
        elif "Attention" in cls:
            _lift_attention(ops, trace, spec, facts, layers, weight, own, seq, rope_type, rotary_dim, path)
            if "aten._softmax.default" in seq:
                before = seq[
                    max(0, seq.index("aten._softmax.default") - 3) : seq.index("aten._softmax.default")
                ]
                if {"aten.add.Tensor", "aten.masked_fill.Scalar"} & set(before):
                    fusion("fuse_mask_softmax", path, layers, weight, "mask add/fill right before softmax")
        elif "DecoderLayer" in cls and "aten.add.Tensor" in own:
            norms = [k for k, v in facts.children.items() if v.endswith("RMSNorm")]
            if norms:
                fusion(
                    "fuse_residual_rmsnorm", path, layers, weight, f"residual add before {', '.join(norms)}"
                )

    for group in trace.shared_inputs:
        layers = trace.layers_of(group[0])
        weight = max(1, len(layers))
        leaves = [p.split(".self_attn.")[-1].split(".mlp.")[-1] for p in group]
        name = (
            "fuse_gate_up_projection"
            if ".mlp." in group[0] and not any("attn" in p for p in group)
            else "fuse_qkv_projection"
        )
        evidence = " + ".join(leaves) + " read the same input"
        fusion(name, group[0].rsplit(".", 1)[0], layers, weight, evidence)
        if evidence not in fusions[name]["evidence"]:
            fusions[name]["evidence"] += f"; {evidence}"
    add_quant_ops(ops, spec, fusions)
    return ops.values(), fusion_rows(fusions)


def _lift_attention(
    ops: OpSet,
    trace: ModelTrace,
    spec: ModelSpec,
    facts: ModuleFacts,
    layers,
    weight: int,
    own: set[str],
    seq: list[str],
    rope_type: str,
    rotary_dim: int,
    path: str,
) -> None:
    attrs = facts.attrs
    layer_spec = spec.layers[layers[0]].attention if layers else None
    if "indexer" in facts.children:
        name = "attention_mla_sparse"
        detail = (
            f"{attrs.get('num_heads')} heads, latent {attrs.get('kv_lora_rank')} + rope "
            f"{attrs.get('qk_rope_head_dim')}, attends to the indexer's top-"
            f"{layer_spec.index_topk if layer_spec else '?'} tokens"
        )
        cache = "kv_cache_mla_latent"
    elif "kv_lora_rank" in attrs:
        name = "attention_mla"
        detail = (f"{attrs.get('num_heads')} heads, latent {attrs.get('kv_lora_rank')} "
                  f"+ rope {attrs.get('qk_rope_head_dim')}")
        cache = "kv_cache_mla_latent"
    else:
        window = attrs.get("sliding_window")
        sinks = "sinks" in facts.tensors
        groups = attrs.get("num_key_value_groups", 1)
        heads = layer_spec.num_heads if layer_spec else None
        kv_heads = layer_spec.num_kv_heads if layer_spec else None
        base = "attention_sliding_window" if window else "attention_gqa"
        name = base + ("_sinks" if sinks else "")
        kind = "GQA" if groups and groups > 1 else "MHA"
        detail = f"{kind} {heads}/{kv_heads} heads, head dim {attrs.get('head_dim')}"
        if window:
            detail += f", window {window}"
        if sinks:
            detail += ", learned sinks"
        cache = "kv_cache_paged"
    ops.add(name, detail, layers, weight, "trace", path, own)
    if cache == "kv_cache_mla_latent":
        cache_detail = (
            f"{attrs.get('kv_lora_rank')} latent + {attrs.get('qk_rope_head_dim')} rope values per token"
        )
    else:
        cache_detail = (
            f"K and V, {layer_spec.num_kv_heads if layer_spec else '?'} heads x {attrs.get('head_dim')}"
            + (f", window {attrs.get('sliding_window')}" if attrs.get("sliding_window") else "")
        )
    ops.add(cache, cache_detail, layers, weight, "spec", path)
    interleaved = any(op.startswith("aten.slice.Tensor[step=") for op in own)
    head_dim = attrs.get("qk_head_dim") or attrs.get("head_dim") or 0
    rot = attrs.get("qk_rope_head_dim") or rotary_dim
    ops.add(
        ROPE_NAMES.get(rope_type, f"rope_{rope_type}"),
        rope_detail(spec, interleaved, rot, head_dim, "attention"),
        layers,
        weight,
        "trace",
        path,
    )


# ---------------------------------------------------------------- the stage


@dataclass
class Inventory:
    """Everything stage 1 found: the report plus the detail behind it.

    rows: classified operators; fusions: fusion candidates; aten: aggregated aten calls of the
    traced layers (empty when the list came from the spec); trace: None when spec-based
    """

    report: StageReport
    rows: list[GapRow]
    fusions: list[dict[str, Any]]
    aten: list[dict[str, Any]]
    trace: ModelTrace | None


def build_inventory(
    model: str,
    target: str,
    stack: str | None = None,
    gates: dict | None = None,
    *,
    all_layers: bool = False,
    prefill_tokens: int = PREFILL_TOKENS,
) -> Inventory:
    """Stage 1 with its detail. model: preset, config.json or model directory; target: name or YAML;
    stack: stack name or YAML (default: the target's default_stack); gates: the full gates dict."""
    started = now_iso()
    gates = gates if gates is not None else load_gates()
    thresholds = gates.get("inventory", {})
    spec = load_spec(model)
    tgt = load_target(target)
    table = load_stack(stack or tgt.default_stack)
    report = StageReport(stage="inventory", number=1, title="Operator inventory and gaps", started=started)

    trace = None
    try:
        _refuse_trace_of_unlifted(spec)
        trace = trace_model(spec.config, prefill_tokens=prefill_tokens, all_layers=all_layers)
    except TraceUnavailable as exc:
        report.add(
            "warn",
            "inventory.spec_only",
            f"the operator list is from the ModelSpec, not a trace: {exc}",
            "counts are per forward step as the spec implies them; run with a transformers that "
            "implements this architecture to trace it",
        )
    if trace is not None:
        ops, fusions = lift_trace(trace, spec)
        _cross_check(report, ops, spec)
        _trace_notes(report, trace, spec)
    else:
        ops, fusions = ops_from_spec(spec)
    if spec.quant.source != "none" and trace is not None:
        report.add(
            "info",
            "inventory.quant_from_spec",
            f"quantization operators come from the spec's quantization_config ({spec.quant.source}); "
            "the trace ran the unquantized graph (quantization_config dropped)",
        )

    rows = [classify(op, table, tgt) for op in ops]
    rows.sort(key=lambda r: list(OP_KINDS).index(r.op.name) if r.op.name in OP_KINDS else len(OP_KINDS))
    fusion_table = []
    for row in fusions:
        entry = table.lookup(row["candidate"])
        fusion_table.append(
            {
                "candidate": row["candidate"],
                "what": row["what"],
                "where": row["where"],
                "evidence": row["evidence"],
                "count": row["count"],
                "layers": format_layers(row["layers"]),
                "stack": f"{entry.status}: {entry.reason}" if entry else f"not listed in {table.name}",
            }
        )
    _gate(report, rows, int(thresholds.get("max_missing", 0)))
    if any("[" in r.provided for r in rows):
        report.add("info", "inventory.sources",
                   f"bracketed tags such as [fp8-doc] cite the sources listed at the top of {table.path}")

    counts = {
        status: sum(1 for r in rows if r.status == status)
        for status in ("native", "composable", "adapt_kernel", "missing")
    }
    report.metrics = {
        "operators": len(rows),
        "per_status": counts,
        "missing_without_plan": sum(1 for r in rows if r.status == "missing" and not r.plan),
        "origin": "trace" if trace else "spec",
        "model_type": spec.model_type,
        "layers": spec.num_layers,
        "stack": table.name,
        "target": tgt.name,
    }
    if trace is not None:
        report.metrics["trace"] = {
            "seconds": round(trace.seconds, 3),
            "import_seconds": round(trace.import_seconds, 3),
            "peak_rss_bytes": trace.peak_rss_bytes,
            "rss_growth_bytes": trace.rss_growth_bytes,
            "meta_parameter_bytes": trace.meta_parameter_bytes,
            "traced_layers": sorted(trace.layer_groups),
            "prefill_tokens": trace.prefill_tokens,
            "aten_operators": len({c.op for c in trace.calls}),
            "transformers": trace.transformers_version,
        }
    report.tables["operator gaps"] = [r.row() for r in rows]
    report.tables["operator variants"] = [
        {"op": r.op.name, "variant": r.op.detail, "origin": r.op.origin,
         "modules": ", ".join(sorted(r.op.modules))}
        for r in rows
    ]
    report.tables["counts per status"] = [{"status": k, "operators": v} for k, v in counts.items()]
    report.tables["fusion candidates"] = fusion_table
    report.summary = (
        f"{len(rows)} operators of {spec.model_type} on {tgt.name} with stack {table.name}: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + (f"; traced in {trace.seconds:.1f} s on the meta device" if trace else "; from the spec")
    )
    report.fingerprint = fingerprint(
        spec_hash=spec.spec_hash(),
        target=tgt.name,
        stack=table.name,
        stack_path=table.path,
        all_layers=all_layers,
        prefill_tokens=prefill_tokens,
        gates=thresholds,
    )
    report.finished = now_iso()
    report.decide()
    aten = (
        [
            {
                "op": c.op,
                "module": c.module,
                "module_class": c.module_class,
                "phase": c.phase,
                "calls": c.calls,
                "layers": format_layers(trace.layers_of(c.module)),
                "dtypes": list(c.dtypes),
                "shape": list(c.shape),
            }
            for c in trace.calls
        ]
        if trace
        else []
    )
    return Inventory(report=report, rows=rows, fusions=fusion_table, aten=aten, trace=trace)


def _refuse_trace_of_unlifted(spec: ModelSpec) -> None:
    """Raise TraceUnavailable for models whose operators the trace lifting does not know yet:
    a vision tower or linear-attention layers would be lifted as plain attention and linears."""
    parts = []
    if spec.vision is not None:
        parts.append("a vision tower")
    if any(layer.attention.kind == "linear" for layer in spec.layers):
        parts.append("linear-attention (Gated DeltaNet) layers")
    if any(layer.attention.kind == "chunked" for layer in spec.layers):
        parts.append("chunked local attention")
    if parts:
        raise TraceUnavailable(f"{spec.model_type} has {' and '.join(parts)}, which adapt's trace lifting "
                               "does not recognise yet")


def run_inventory(
    model: str, target: str, stack: str | None = None, gates: dict | None = None
) -> StageReport:
    """Stage 1 as a gated report (stage "inventory", number 1)."""
    return build_inventory(model, target, stack=stack, gates=gates).report


def _gate(report: StageReport, rows: list[GapRow], max_missing: int) -> None:
    unplanned = [r for r in rows if r.status == "missing" and not r.plan]
    severity = "error" if len(unplanned) > max_missing else "warn"
    for r in unplanned:
        report.add(
            severity,
            "inventory.missing",
            f"{r.op.name}: {r.provided}",
            "add an adapt kernel or a stack entry with a plan, or choose another stack/target",
        )
    for r in rows:
        if r.status == "missing" and r.plan:
            report.add("warn", "inventory.gap_with_plan", f"{r.op.name}: {r.provided}", f"plan: {r.plan}")
        elif r.status == "composable":
            report.add("warn", "inventory.composable", f"{r.op.name}: {r.provided}")
        elif r.status == "adapt_kernel":
            report.add(
                "info",
                "inventory.adapt_kernel",
                f"{r.op.name}: {r.kernel}",
                f"stage 3 runs its tolerance test {r.test}",
            )
    if len(unplanned) > max_missing:
        report.add(
            "error",
            "inventory.gate",
            f"{len(unplanned)} operator(s) missing without a plan (gate allows {max_missing})",
        )


def _cross_check(report: StageReport, ops: list[SemanticOp], spec: ModelSpec) -> None:
    """Operators the spec implies but the trace did not show (or the other way round) are flagged."""
    traced = {op.name for op in ops if op.origin == "trace"}
    expected = {op.name for op in ops_from_spec(spec)[0] if op.origin == "spec" and op.kind != "kv cache"}
    for name in sorted(expected - traced):
        report.add(
            "warn",
            "inventory.not_traced",
            f"the spec implies {name} but the trace did not show it",
            "the transformers implementation may differ from the checkpoint's architecture",
        )
    for name in sorted(traced - expected):
        report.add("info", "inventory.trace_only", f"the trace shows {name}, which the spec does not imply")


def _trace_notes(report: StageReport, trace: ModelTrace, spec: ModelSpec) -> None:
    traced = sorted(trace.layer_groups)
    if len(traced) < trace.num_layers:
        groups = "; ".join(f"layer {i} stands for {format_layers(trace.layer_groups[i])}" for i in traced)
        report.add(
            "info",
            "inventory.representative_layers",
            f"traced {len(traced)} of {trace.num_layers} decoder layers, one per distinct structure "
            f"({groups}); counts are scaled by the layers each stands for",
        )
    if spec.mtp_layers:
        report.add(
            "info",
            "inventory.mtp_not_traced",
            f"{len(spec.mtp_layers)} multi-token-prediction layer(s) "
            f"({format_layers(layer.index for layer in spec.mtp_layers)}) are not built by transformers and "
            "not listed; they use the operators of a MoE layer plus eh_proj (linear) and two RMSNorms",
        )
    report.add(
        "info",
        "inventory.trace_cost",
        f"meta-device build + trace: {trace.seconds:.1f} s (+{trace.import_seconds:.1f} s importing "
        f"torch/transformers), peak RSS {trace.peak_rss_bytes / 2**30:.2f} GiB "
        f"(+{trace.rss_growth_bytes / 2**20:.0f} MiB during the trace); the parameters would take "
        f"{trace.meta_parameter_bytes / 2**30:,.0f} GiB if materialised",
    )
