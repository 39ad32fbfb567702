"""Stage 5, precision alignment: adapt's adapted path against a float32 reference, layer by layer and end to end.

The adapted path is the configuration the target would run: adapt's Triton kernels for the op
families in ``kernels``, the expert format of ``weights`` (FP8 online conversion for fp8 /
mxfp4-online / mxfp4-offline-fp8), the FP8 or bf16 indexer and KV cache, in the compute dtype
(bf16 by default). The reference is adapt's torch path in float32 with every component as stored
(``tests/runtime/test_engine.py`` proves it equal to transformers); where transformers can hold the
model (whole depth, checkpoint under 2 GiB) its float32 logits on the same tokens are compared too.

Inputs (bundled, ``adapt/eval/data``): a text sample (perplexity and per-position metrics) and
prompts whose reference greedy continuations (``greedy_tokens`` each) the adapted path is fed in
the same single prefill step. Per-position argmax of that step equals greedy decoding up to the
first divergence, so the first divergence is measured without running the decode loop.

Metrics: per-layer hidden-state relative error (rows whose routing agreed so far, and all rows) and
its growth with depth (table + PNG); per MoE layer top-k agreement and flips, each flip near-tie or
real by the reference's score gap; per expert, on the same inputs, the adapted expert's gain
<y_adapted, y_ref> / <y_ref, y_ref> and relative error (a scale error hides in a layer's noise but
not in its gain); per DSA layer the overlap of the selected positions with the reference and with
the same-quantization (FP8) reference; logits KL(ref || adapted), top-1 agreement, top-5 overlap;
perplexity of both on the sample; greedy first divergence per prompt, near-tie or real.

Attribution: when a gate fails, the adapted run is repeated with one component moved back at a
time (each kernel family to its torch twin, experts as stored, indexer to bf16, KV cache to bf16);
every move is reported with the gates it passes, its memory cost (stage 2's numbers in the run
directory) and the exact command that applies it.

qwen3_next and llama4 go through their own reference paths instead (``run_family_precision``).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from adapt.errors import InputError
from adapt.report import StageReport, checkpoint_data_digest

DATA = Path(__file__).resolve().parents[1] / "eval" / "data"
GATE_KEYS = (
    "max_rel_error_layer", "min_greedy_match_tokens", "greedy_tokens", "max_kl", "min_top1_agreement",
    "min_top5_overlap", "max_ppl_increase", "router_tie_gap", "max_real_flip_rate", "min_dsa_overlap",
    "logit_tie_gap", "max_expert_gain_error", "max_rel_error_expert", "max_reference_logit_error",
)
FP8_WEIGHTS = ("fp8", "mxfp4-online", "mxfp4-offline-fp8")
EXPERT_ROWS = 64  # rows of layer input each expert is checked on
EXPERT_CHECKS = 16  # experts checked per MoE layer (the reference's busiest; all of them when there are fewer)
SAMPLE_TOKENS = 64  # tokens of the bundled text sample used (perplexity and per-position metrics)
_REFERENCES: dict[tuple, dict] = {}  # the last reference run per (model and its contents' digest, layers, device,
# inputs): reused by the attribution's reruns


@dataclass(frozen=True)
class Adapted:
    """The adapted configuration: kernel families, formats, compute dtype."""

    kernels: str = "all"
    weights: str = "as-stored"
    indexer_dtype: str = "fp8"
    kv_dtype: str = "bf16"
    dtype: str = "bf16"

    def formats(self):
        from adapt.runtime.variants import Formats

        return Formats(experts="fp8" if self.weights in FP8_WEIGHTS else "as-stored",
                       indexer=self.indexer_dtype, kv_cache=self.kv_dtype)

    def flags(self) -> list[str]:
        return ["--kernels", self.kernels, "--weights", self.weights, "--indexer-dtype", self.indexer_dtype,
                "--kv-dtype", self.kv_dtype, "--compute-dtype", self.dtype]


@dataclass
class Run:
    """One engine's pass over the sequences: fp32 logits per sequence [L, vocab] and its capture."""

    logits: list[torch.Tensor]
    capture: Any
    engine: Any
    kernel_families: list[str] = field(default_factory=list)


def read_gates(gates: dict) -> dict[str, float]:
    """Every key of the ``precision:`` section (all required; unknown keys refused)."""
    section = dict(gates.get("precision") or {})
    missing = [k for k in GATE_KEYS if k not in section]
    unknown = [k for k in section if k not in GATE_KEYS]
    if missing or unknown:
        raise InputError(f"precision section: missing {missing or 'none'}, unknown {unknown or 'none'}",
                         file="gates", field="precision", hint=f"keys: {', '.join(GATE_KEYS)}")
    return {k: float(section[k]) for k in GATE_KEYS}


def _dtype(name: str) -> torch.dtype:
    table = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if name not in table:
        raise InputError(f"unknown compute dtype {name!r}", field="--compute-dtype", hint="bf16 or fp32")
    return table[name]


def _encode(model_dir: Path, vocab: int) -> tuple[list[int], list[list[int]]]:
    """Token ids of the bundled text sample and prompts (the model's tokenizer, else bytes mod vocab)."""
    text = (DATA / "sample.txt").read_text().strip()
    prompts = [p for p in (DATA / "prompts.txt").read_text().splitlines() if p.strip()][:2]
    if (model_dir / "tokenizer.json").exists():
        # the tokenizer file alone: AutoTokenizer would parse config.json, which older transformers may refuse
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        encode = lambda s: tok.encode(s, add_special_tokens=False).ids
    else:
        encode = lambda s: [3 + b % max(vocab - 3, 1) for b in s.encode()]
    return encode(text)[:SAMPLE_TOKENS], [encode(p) for p in prompts]


def _forward(engine, sequences: list[list[int]], dsa: bool) -> tuple[list[torch.Tensor], Any]:
    """One prefill step over every sequence: per sequence fp32 logits [L, vocab] (CPU) and the capture."""
    with engine.capture(hidden_states=True, router=True, dsa_indices=dsa) as cap:
        ids = engine.start(len(sequences))
        try:
            logits = engine.step(ids, sequences, all_logits=True)
        finally:
            engine.release(ids)
    return [x.float().cpu() for x in logits], cap


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def compare_layers(ref_cap, ad_cap) -> list[dict[str, Any]]:
    """Per decoder layer: error on rows whose routing agreed in every MoE layer so far, on all rows,
    the fraction of rows counted, and growth (error / first layer's error)."""
    rows_out, agree = [], None
    for layer in sorted(ref_cap.hidden_states):
        ref = ref_cap.hidden_states[layer][0].float().cpu()
        out = ad_cap.hidden_states[layer][0].float().cpu()
        if layer in ref_cap.router and layer in ad_cap.router:
            a = ref_cap.router[layer][0][0].cpu().sort(-1).values
            b = ad_cap.router[layer][0][0].long().cpu().sort(-1).values
            same = (a == b).all(-1)
            agree = same if agree is None else agree & same
        mask = torch.ones(ref.shape[0], dtype=torch.bool) if agree is None else agree
        err = _rel(out[mask], ref[mask]) if mask.any() else float("nan")
        rows_out.append({"layer": layer, "rel_error": err, "rel_error_all_rows": _rel(out, ref),
                         "agreeing_rows": float(mask.float().mean())})
    first = next((r["rel_error"] for r in rows_out if r["rel_error"] > 0), None)
    for r in rows_out:
        r["growth"] = r["rel_error"] / first if first else float("nan")
    return rows_out


def compare_routing(ref_cap, ad_cap, tie_gap: float) -> list[dict[str, Any]]:
    """Per MoE layer: top-k set agreement, flips, and flips classified by the reference's score gap.

    A flipped row swaps some experts; gap = largest reference score among experts only the reference
    chose minus the smallest among experts only the adapted path chose, over the row's score range
    (max - min of the finite scores). gap <= tie_gap: near tie; otherwise real.
    """
    out = []
    for layer in sorted(ref_cap.router):
        if layer not in ad_cap.router:
            continue
        a = ref_cap.router[layer][0][0].cpu()
        b = ad_cap.router[layer][0][0].long().cpu()
        scores = ref_cap.router_scores[layer][0].float().cpu() if layer in ref_cap.router_scores else None
        ties = real = 0
        for row in range(a.shape[0]):
            sa, sb = set(a[row].tolist()), set(b[row].tolist())
            if sa == sb:
                continue
            if scores is None:
                real += 1
                continue
            s = scores[row]
            finite = s[torch.isfinite(s)]
            spread = float(finite.max() - finite.min()) or 1.0
            gap = (max(float(s[e]) for e in sa - sb) - min(float(s[e]) for e in sb - sa)) / spread
            if gap <= tie_gap:
                ties += 1
            else:
                real += 1
        n = a.shape[0]
        out.append({"layer": layer, "agreement": 1 - (ties + real) / n, "flips": ties + real,
                    "near_tie_flips": ties, "real_flips": real, "real_flip_rate": real / n})
    return out


def dsa_overlap(ref_cap, ad_cap) -> dict[int, float]:
    """DSA layer -> mean over rows of |selected_ref & selected_adapted| / |selected_ref|."""
    out = {}
    for layer, steps in ref_cap.dsa_indices.items():
        if layer not in ad_cap.dsa_indices:
            continue
        shares = []
        for x, y in zip(steps[0].tolist(), ad_cap.dsa_indices[layer][0].tolist(), strict=True):
            chosen = {i for i in x if i >= 0}
            shares.append(len(chosen & {i for i in y if i >= 0}) / max(len(chosen), 1))
        out[layer] = sum(shares) / len(shares)
    return out


def compare_logits(ref: list[torch.Tensor], ad: list[torch.Tensor], tie_gap: float | None = None) -> dict[str, float]:
    """KL(ref || adapted) in nats (mean over positions), top-1 agreement, top-5 overlap, max rel error.

    With ``tie_gap`` (nats) also ``top1_near_ties``: positions whose top-1 differs where the reference ranks
    its own top token at most ``tie_gap`` above the adapted one (the rule of ``greedy_divergence``), and
    ``top1_agreement_beyond_ties``: the agreement that counts those positions as agreeing."""
    r, a = torch.cat(ref), torch.cat(ad)
    lr, la = torch.log_softmax(r, -1), torch.log_softmax(a, -1)
    kl = (lr.exp() * (lr - la)).sum(-1)
    t5r, t5a = r.topk(5, -1).indices, a.topk(5, -1).indices
    overlap = (t5r[:, :, None] == t5a[:, None, :]).any(-1).float().sum(-1) / 5
    top_r, top_a = r.argmax(-1), a.argmax(-1)
    out = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
           "top1_agreement": float((top_r == top_a).float().mean()),
           "top5_overlap": float(overlap.mean()), "logit_rel_error": _rel(a, r)}
    if tie_gap is not None:
        gap = lr.gather(-1, top_r[..., None]) - lr.gather(-1, top_a[..., None])
        tie = (top_r != top_a) & (gap.squeeze(-1) <= tie_gap)
        out["top1_near_ties"] = int(tie.sum())
        out["top1_agreement_beyond_ties"] = float(((top_r == top_a) | tie).float().mean())
    return out


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    """exp(mean NLL of tokens[1:] given logits[:-1]) (logits fp32 [L, vocab])."""
    target = torch.tensor(tokens[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target)
    return float(torch.exp(nll))


def greedy_divergence(ref_logits: torch.Tensor, ad_logits: torch.Tensor, prompt_len: int, continuation: list[int],
                      tie_gap: float) -> dict[str, Any]:
    """First position where the adapted argmax leaves the reference's greedy continuation.

    Returns matched tokens, and, at a divergence, the reference log-probability gap between its own
    token and the adapted one (<= tie_gap nats: near tie).
    """
    for i, token in enumerate(continuation):
        row = prompt_len - 1 + i
        chosen = int(ad_logits[row].argmax())
        if chosen != token:
            logp = torch.log_softmax(ref_logits[row].float(), -1)
            gap = float(logp[token] - logp[chosen])
            return {"matched": i, "diverged": True, "gap_nats": gap, "near_tie": gap <= tie_gap}
    return {"matched": len(continuation), "diverged": False, "gap_nats": None, "near_tie": False}


def compare_experts(ref_engine, ad_engine, ref_cap) -> list[dict[str, Any]]:
    """Per MoE layer and expert (``_busiest_experts``), on the same rows (the RMS-normalized reference input
    of that layer, first ``EXPERT_ROWS`` rows): the adapted expert's gain and relative error against the
    reference's."""
    from adapt.runtime.moe import MoE

    out = []
    layers = sorted(ref_cap.hidden_states)
    for ref_layer, ad_layer in zip(ref_engine.model.layers, ad_engine.model.layers, strict=True):
        if not isinstance(ref_layer.ffn, MoE):
            continue
        before = [i for i in layers if i < ref_layer.index]
        if not before:
            continue
        x = ref_cap.hidden_states[before[-1]][0][:EXPERT_ROWS].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        for e in _busiest_experts(ref_cap, ref_layer.index, ref_layer.ffn.experts.count):
            y_ref = ref_layer.ffn.expert_forward(x.to(ref_engine.model.dtype), e).float().cpu()
            y_ad = ad_layer.ffn.expert_forward(x.to(ad_engine.model.dtype), e).float().cpu()
            gain = float((y_ad * y_ref).sum() / (y_ref * y_ref).sum().clamp_min(1e-30))
            out.append({"layer": ref_layer.index, "expert": e, "gain": gain, "rel_error": _rel(y_ad, y_ref)})
    return out


def _busiest_experts(ref_cap, layer: int, count: int) -> list[int]:
    """The (at most ``EXPERT_CHECKS``) experts the reference routed most rows to in ``layer``, ascending."""
    if count <= EXPERT_CHECKS or layer not in ref_cap.router:
        return list(range(count))
    hits = torch.bincount(ref_cap.router[layer][0][0].reshape(-1).cpu(), minlength=count)
    return sorted(hits.topk(EXPERT_CHECKS).indices.tolist())


def _load(model_dir: Path, layers, kernels: str, dtype: torch.dtype, formats, faults, device: str, tokens: int):
    from adapt.runtime.engine import Engine

    workspace = 0
    if device == "cuda" and formats.experts == "fp8":
        workspace = 16
    return Engine.load(model_dir, layers=layers, kernels=kernels, dtype=dtype, device=device,
                       max_tokens=tokens, moe_workspace=workspace, formats=formats, faults=faults)


def evaluate(model_dir: Path, adapted: Adapted, limits: dict[str, float], *, layers=None, device: str = "cpu",
             faults=None, reference=None) -> dict[str, Any]:
    """Run the reference (unless given) and the adapted path; returns metrics, tables and gate failures."""
    from adapt.model.spec import load_spec
    from adapt.runtime.engine import Engine
    from adapt.runtime.moe import MoE
    from adapt.runtime.variants import Formats

    config = load_spec(model_dir)
    text, prompts = _encode(model_dir, config.vocab)
    greedy = int(limits["greedy_tokens"])
    budget = len(text) + sum(len(p) + greedy for p in prompts) + 256
    dsa = any(layer.attention.kind == "mla+dsa" for layer in config.layers)
    # keyed by the checkpoint's contents: a model rewritten in place in this process gets a new reference
    key = (str(model_dir), checkpoint_data_digest(str(model_dir)), tuple(layers or ()), device, greedy,
           dsa and adapted.indexer_dtype == "fp8")
    if reference is None and key in _REFERENCES:
        reference = _REFERENCES[key]
    if reference is None:
        ref_engine = Engine.load(model_dir, layers=layers, kernels="none", dtype=torch.float32, device=device,
                                 max_tokens=budget, formats=Formats(), faults=None)
        continuations = ref_engine.generate(prompts, greedy, stop_ids=()).tokens
        sequences = [text] + [p + c for p, c in zip(prompts, continuations, strict=True)]
        ref_logits, ref_cap = _forward(ref_engine, sequences, dsa)
        same_quant = None
        if dsa and adapted.indexer_dtype == "fp8":
            sq_engine = Engine.load(model_dir, layers=layers, kernels="none", dtype=torch.float32, device=device,
                                    max_tokens=budget, formats=Formats(indexer="fp8"))
            same_quant = _forward(sq_engine, sequences, True)[1]
            del sq_engine
        reference = {"engine": ref_engine, "logits": ref_logits, "capture": ref_cap, "sequences": sequences,
                     "prompts": prompts, "continuations": continuations, "text": text, "same_quant": same_quant}
        _REFERENCES.clear()
        _REFERENCES[key] = reference
    ad_engine = _load(model_dir, layers, adapted.kernels, _dtype(adapted.dtype), adapted.formats(), faults, device,
                      budget)
    ad_logits, ad_cap = _forward(ad_engine, reference["sequences"], dsa)
    ref_cap, ref_logits = reference["capture"], reference["logits"]

    layer_rows = compare_layers(ref_cap, ad_cap)
    routing = compare_routing(ref_cap, ad_cap, limits["router_tie_gap"])
    overlap_exact = dsa_overlap(ref_cap, ad_cap)
    overlap_same = dsa_overlap(reference["same_quant"], ad_cap) if reference["same_quant"] is not None else {}
    logits = compare_logits(ref_logits, ad_logits)
    ppl_ref = perplexity(ref_logits[0], reference["text"])
    ppl_ad = perplexity(ad_logits[0], reference["text"])
    greedy_rows = []
    for i, (prompt, cont) in enumerate(zip(reference["prompts"], reference["continuations"], strict=True)):
        row = greedy_divergence(ref_logits[i + 1], ad_logits[i + 1], len(prompt), cont, limits["logit_tie_gap"])
        greedy_rows.append({"prompt": i, **row})
    experts = compare_experts(reference["engine"], ad_engine, ref_cap)

    failures = []

    def gate(ok: bool, code: str, message: str):
        if not ok:
            failures.append((code, message))

    worst_layer = max((r["rel_error"] for r in layer_rows if not math.isnan(r["rel_error"])), default=0.0)
    gate(worst_layer <= limits["max_rel_error_layer"], "layer-error",
         f"largest per-layer relative error {worst_layer:.3g} > {limits['max_rel_error_layer']:g}")
    worst_flip = max((r["real_flip_rate"] for r in routing), default=0.0)
    gate(worst_flip <= limits["max_real_flip_rate"], "routing-flips",
         f"real routing flips in {worst_flip:.1%} of rows > {limits['max_real_flip_rate']:.1%}")
    overlap_gate = overlap_same or overlap_exact
    worst_overlap = min(overlap_gate.values(), default=1.0)
    gate(worst_overlap >= limits["min_dsa_overlap"], "dsa-overlap",
         f"DSA top-k overlap {worst_overlap:.3f} < {limits['min_dsa_overlap']:g}")
    gate(logits["kl_mean"] <= limits["max_kl"], "kl",
         f"KL(ref||adapted) {logits['kl_mean']:.3g} > {limits['max_kl']:g}")
    gate(logits["top1_agreement"] >= limits["min_top1_agreement"], "top1",
         f"top-1 agreement {logits['top1_agreement']:.3f} < {limits['min_top1_agreement']:g}")
    gate(logits["top5_overlap"] >= limits["min_top5_overlap"], "top5",
         f"top-5 overlap {logits['top5_overlap']:.3f} < {limits['min_top5_overlap']:g}")
    increase = ppl_ad / ppl_ref - 1
    gate(increase <= limits["max_ppl_increase"], "perplexity",
         f"perplexity {ppl_ad:.3f} vs reference {ppl_ref:.3f} (+{increase:.2%} > {limits['max_ppl_increase']:.2%})")
    short = [r for r in greedy_rows if r["diverged"] and not r["near_tie"]
             and r["matched"] < limits["min_greedy_match_tokens"]]
    first = min((r["matched"] for r in short), default=0)
    gate(not short, "greedy", f"{len(short)} prompt(s) diverge for real before "
         f"{int(limits['min_greedy_match_tokens'])} tokens (first at token {first})")
    # an MoE layer kept with no expert compared (no captured input before it) is unmeasured, not 0.0
    moe_kept = any(isinstance(layer.ffn, MoE) for layer in ad_engine.model.layers)
    unmeasured = [("experts", "per-expert gain and relative error", "no kept layer before an MoE layer feeds its "
                   "experts (keep a layer before the first MoE layer in --layers)")] if moe_kept and not experts else []
    worst_gain = max((abs(r["gain"] - 1) for r in experts), default=None if unmeasured else 0.0)
    worst_expert = max((r["rel_error"] for r in experts), default=None if unmeasured else 0.0)
    if not unmeasured:
        gate(worst_gain <= limits["max_expert_gain_error"], "expert-gain",
             f"expert gain off by {worst_gain:.3g} > {limits['max_expert_gain_error']:g}")
        gate(worst_expert <= limits["max_rel_error_expert"], "expert-error",
             f"expert relative error {worst_expert:.3g} > {limits['max_rel_error_expert']:g}")

    metrics = {
        "max_rel_error_layer": worst_layer,
        "error_growth_last_over_first": layer_rows[-1]["growth"] if layer_rows else None,
        "router_agreement_min": min((r["agreement"] for r in routing), default=1.0),
        "real_flip_rate_max": worst_flip,
        "near_tie_flips": sum(r["near_tie_flips"] for r in routing),
        "real_flips": sum(r["real_flips"] for r in routing),
        "dsa_overlap_vs_reference": overlap_exact,
        "dsa_overlap_vs_same_quantization": overlap_same,
        **logits,
        "perplexity_reference": ppl_ref,
        "perplexity_adapted": ppl_ad,
        "greedy_min_matched": min(r["matched"] for r in greedy_rows),
        "expert_gain_error_max": worst_gain,
        "expert_rel_error_max": worst_expert,
        "kernel_refusals": ad_engine.model.kernel_refusals,
    }
    tables = {
        "per-layer hidden-state error": layer_rows,
        "routing per MoE layer": routing,
        "greedy continuation per prompt": greedy_rows,
        "experts (worst 8 by |gain - 1|)": sorted(experts, key=lambda r: -abs(r["gain"] - 1))[:8],
    }
    return {"metrics": metrics, "tables": tables, "failures": failures, "reference": reference,
            "layer_rows": layer_rows, "unmeasured": unmeasured}


def plot_layers(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """PNG of per-layer relative error (agreeing rows and all rows) against layer index."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [r["layer"] for r in rows]
    ax.plot(xs, [max(r["rel_error"], 1e-9) for r in rows], "o-", label="rows with agreeing routing")
    ax.plot(xs, [max(r["rel_error_all_rows"], 1e-9) for r in rows], "s--", label="all rows")
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("||adapted - ref|| / ||ref||")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def rollback_moves(adapted: Adapted, families: list[str]) -> list[tuple[str, str, Adapted]]:
    """(component, move, configuration) for every component that is adapted now."""
    moves = []
    for family in families:
        rest = [f for f in families if f != family]
        moves.append((family, f"{family} kernel -> torch twin", replace(adapted, kernels=",".join(rest) or "none")))
    if adapted.weights in FP8_WEIGHTS:
        moves.append(("experts", "experts FP8 -> as stored", replace(adapted, weights="as-stored")))
    if adapted.indexer_dtype == "fp8":
        moves.append(("indexer", "indexer FP8 -> bf16", replace(adapted, indexer_dtype="bf16")))
    if adapted.kv_dtype == "fp8":
        moves.append(("kv_cache", "KV cache FP8 -> bf16", replace(adapted, kv_dtype="bf16")))
    return moves


def _active_families(model_dir: Path, adapted: Adapted, layers) -> list[str]:
    """Op families that really run adapt's kernels in this model (asked for and not refused)."""
    from adapt.model.spec import load_spec
    from adapt.runtime.engine import parse_kernels

    config = load_spec(model_dir)
    paths = parse_kernels(adapted.kernels)
    active = [f for f, p in paths.items() if p == "kernel"]
    if not any(layer.attention.kind == "mla+dsa" for layer in config.layers) or adapted.indexer_dtype == "bf16":
        active = [f for f in active if f != "indexer"]
    if "moe" in active and not config.moe_layers:
        active.remove("moe")
    return active


def memory_costs(run_dir: Path | None) -> dict[str, int | None]:
    """Extra bytes per device of each rollback, from stage 2's report in the run directory (None: unknown)."""
    import json

    costs: dict[str, int | None] = {"kv_cache": None, "experts": None, "indexer": None}
    path = None if run_dir is None else Path(run_dir) / "memory.json"
    if path is None or not path.is_file():
        return costs
    metrics = json.loads(path.read_text()).get("metrics", {})
    terms = (metrics.get("terms") or metrics.get("bytes") or {}) if isinstance(metrics, dict) else {}
    if metrics.get("kv_dtype") == "fp8" and isinstance(terms.get("kv_cache"), int | float):
        costs["kv_cache"] = int(terms["kv_cache"])  # bf16 rows are twice the e4m3 rows
    return costs


def command_for(model: str, target: str, adapted: Adapted, layers: str | None, extra: list[str]) -> str:
    """The ``adapt validate`` command of this configuration (extra: the invocation's other options)."""
    args = ["adapt", "validate", model, "--stage", "5", "--target", target, *extra, *adapted.flags()]
    if layers:
        args += ["--layers", layers]
    return shlex.join(args)


def run_precision(model: str, target: str, *, gates: dict, layers: str | None = None, kernels: str = "all",
                  weights: str = "as-stored", indexer_dtype: str = "fp8", kv_dtype: str = "bf16",
                  compute_dtype: str = "bf16", report_dir: str | Path | None = None, attribute: bool = True,
                  faults=None, device: str | None = None, invocation: list[str] | None = None) -> StageReport:
    """Stage 5 (see the module docstring). faults: ``Faults`` test hooks (default: ``ADAPT_TEST_FAULTS``);
    invocation: the other ``adapt validate`` options of this run, repeated in the advised commands."""
    from adapt.model.spec import load_spec
    from adapt.runtime.engine import parse_kernels, parse_layers, resolve_model_dir
    from adapt.runtime.variants import Faults, Formats

    limits = read_gates(gates)
    model_dir = resolve_model_dir(model)
    parse_kernels(kernels)
    Formats(indexer=indexer_dtype, kv_cache=kv_dtype)
    _dtype(compute_dtype)
    config = load_spec(model_dir)
    layer_ids = None if layers is None else parse_layers(layers, config.num_layers)
    faults = Faults.from_env() if faults is None else faults
    from adapt.runtime.families import uses_reference_path

    if uses_reference_path(model_dir):
        adapted = Adapted(kernels=kernels, weights=weights, indexer_dtype=indexer_dtype, kv_dtype=kv_dtype,
                          dtype=compute_dtype)
        return run_family_precision(model_dir, adapted, read_gates(gates), layer_ids, faults, report_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and any(p == "kernel" for p in parse_kernels(kernels).values()):
        from adapt.runtime.engine import prepare_triton

        prepare_triton()
    adapted = Adapted(kernels=kernels, weights=weights, indexer_dtype=indexer_dtype, kv_dtype=kv_dtype,
                      dtype=compute_dtype)
    report = StageReport(stage="precision", number=5, title="Precision alignment")
    result = evaluate(model_dir, adapted, limits, layers=layer_ids, device=device, faults=faults)
    report.metrics = {"adapted": adapted.__dict__, "reference": "adapt torch path, float32, formats as stored",
                      "device": device, "layers": layer_ids or "all", **result["metrics"]}
    if faults.any:
        report.metrics["injected_faults"] = faults.describe()
    report.tables.update(result["tables"])
    anchor = _transformers_anchor(model_dir, layer_ids, result["reference"])
    skipped = anchor_skipped(model_dir, layer_ids, device)
    if skipped is not None:
        how = "run stage 5 without --layers on a CPU machine (checkpoints up to 2 GiB) to compare them"
        report.tables.setdefault(NOT_MEASURED, []).append(
            {"check": "reference vs transformers", "status": "not measured", "reason": skipped, "how": how})
        report.add("warn", "not-measured-reference-anchor",
                   f"reference vs transformers logits: not measured here ({skipped}); the float32 reference is "
                   "trusted from tests/runtime, not checked on these weights", hint=how)
    if anchor is not None:
        report.metrics["reference_vs_transformers_logit_error"] = anchor
        if anchor > limits["max_reference_logit_error"]:
            result["failures"].append(("reference", f"the float32 reference differs from transformers by {anchor:.3g}"))
    if config.model_type == "kimi_k25":
        result["failures"] += _image_input(report, model_dir, layer_ids, adapted, limits, config.vocab, device)
    if report_dir is not None:
        png = plot_layers(result["layer_rows"], Path(report_dir) / "precision_layers.png",
                          f"{model_dir.name}: adapted ({kernels}, {compute_dtype}) vs float32 reference")
        report.artifacts["layer_error_plot"] = png.name
        report.metrics["layer_error_plot"] = str(png)
    for code, check, reason in result["unmeasured"]:
        not_measured(report, code, check, reason)
    for code, message in result["failures"]:
        report.add("error", code, message)
    if result["failures"] and attribute:
        _attribute(report, model, model_dir, target, adapted, limits, layers, layer_ids, device, faults, result,
                   report_dir, invocation or [])
    fails = len(result["failures"])
    report.summary = ("adapted path within every precision gate" if not fails else
                      f"{fails} precision gate(s) failed" + (f"; {report.metrics.get('attributed_to')}"
                                                          if report.metrics.get("attributed_to") else ""))
    return report


def _attribute(report, model, model_dir, target, adapted, limits, layers, layer_ids, device, faults, result,
               report_dir, extra) -> None:
    costs = memory_costs(report_dir)
    rows = []
    for component, move, config in rollback_moves(adapted, _active_families(model_dir, adapted, layer_ids)):
        trial = evaluate(model_dir, config, limits, layers=layer_ids, device=device, faults=faults,
                         reference=result["reference"])
        cost = 0 if component in ("attention", "indexer", "moe", "norm_rope") and "kernel" in move else costs.get(
            component)
        rows.append({"component": component, "move": move, "passes": not trial["failures"],
                     "still_failing": ",".join(code for code, _ in trial["failures"]) or "-",
                     "memory_cost_bytes": cost if cost is not None else "unknown (run stage 2 in this run)",
                     "command": command_for(model, target, config, layers, extra)})
    report.tables["attribution (one component moved back at a time)"] = rows
    fixing = [r for r in rows if r["passes"]]
    if fixing:
        best = min(fixing, key=lambda r: r["memory_cost_bytes"] if isinstance(r["memory_cost_bytes"], int) else 1 << 62)
        report.metrics["attributed_to"] = sorted({r["component"] for r in fixing})
        report.metrics["rollback_command"] = best["command"]
        report.add("error", "rollback", f"moving back {', '.join(r['move'] for r in fixing)} passes every gate",
                   hint=f"run: {best['command']}")
    else:
        report.add("error", "rollback", "no single component moved back passes every gate",
                   hint="the error is spread over components or lies in the reference's inputs")


ANCHOR_MAX_BYTES = 2 * 1024**3  # transformers loads the whole checkpoint in float32 on the CPU for the anchor


def anchor_skipped(model_dir: Path, layer_ids, device: str) -> str | None:
    """Why the float32 reference is not compared with transformers here (a sentence), or None when it is:
    transformers holds the whole model only (no ``--layers``), in float32 on the CPU, up to ``ANCHOR_MAX_BYTES``."""
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    if layer_ids is not None:
        return f"--layers {','.join(map(str, layer_ids))}: transformers builds the whole model, not a reduced depth"
    if device != "cpu":
        return f"the reference ran on {device}; the anchor loads transformers' model on the CPU"
    if size > ANCHOR_MAX_BYTES:
        return (f"the checkpoint holds {size / 2**30:.1f} GiB, above the {ANCHOR_MAX_BYTES / 2**30:.0f} GiB "
                "transformers is loaded whole for in float32")
    return None


def _transformers_anchor(model_dir: Path, layer_ids, reference) -> float | None:
    """Max over sequences of the reference's logit relative error against transformers in float32, when
    transformers can hold the model (``anchor_skipped`` is None); None otherwise."""
    if "transformers_anchor" in reference:
        return reference["transformers_anchor"]
    reference["transformers_anchor"] = None
    if anchor_skipped(model_dir, layer_ids, reference["engine"].model.device.type) is not None:
        return None
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # a multimodal checkpoint whose language model the engine runs (kimi_k25) loads as image-text-to-text;
    # transformers dequantizes MXFP4 experts (gpt-oss) to bf16 whatever dtype is asked for: every E2M1 value
    # times its power-of-two scale is exact in bf16, so .float() restores the float32 model exactly
    auto = AutoModelForImageTextToText if reference["engine"].spec.vision is not None else AutoModelForCausalLM
    hf = auto.from_pretrained(model_dir, dtype=torch.float32).float()
    worst = 0.0
    with torch.no_grad():
        for seq, ref in zip(reference["sequences"], reference["logits"], strict=True):
            out = hf(torch.tensor([seq])).logits[0].float()
            worst = max(worst, _rel(ref, out))
    reference["transformers_anchor"] = worst
    return worst


def _image_input(report: StageReport, model_dir: Path, layer_ids, adapted: Adapted, limits: dict[str, float],
                 vocab: int, device: str) -> list[tuple[str, str]]:
    """kimi_k25 (MoonViT in front of the decoder engine): an image prompt through the adapted path vs
    the float32 one (``adapt.runtime.families.image_prompt_runs``), gated like the text: image features by
    max_rel_error_layer, the prompt's logits by max_kl and min_top1_agreement. Returns the failures."""
    from adapt.runtime.families import image_prompt_runs

    feature_error, ref, ad = image_prompt_runs(model_dir, layer_ids, _dtype(adapted.dtype), adapted.kernels,
                                               _encode(model_dir, vocab)[0][:32], device)
    logits = compare_logits([ref], [ad], tie_gap=limits["logit_tie_gap"])
    report.metrics.update(image_feature_rel_error=feature_error, image_prompt_kl_mean=logits["kl_mean"],
                          image_prompt_top1_agreement=logits["top1_agreement"],
                          image_prompt_top1_near_ties=logits["top1_near_ties"],
                          image_prompt_top1_agreement_beyond_ties=logits["top1_agreement_beyond_ties"])
    failures = []
    if feature_error > limits["max_rel_error_layer"]:
        failures.append(("image-features", f"image feature relative error {feature_error:.3g} > "
                                           f"{limits['max_rel_error_layer']:g}"))
    # a top-1 change the reference ranks within logit_tie_gap is a near tie (bf16 against float32), as for the
    # greedy continuations: the tiny Kimi K2.5's 3 near ties in 98 positions would otherwise read as 0.969 < 0.97
    if logits["kl_mean"] > limits["max_kl"] or logits["top1_agreement_beyond_ties"] < limits["min_top1_agreement"]:
        failures.append(("image-prompt", f"image prompt: KL {logits['kl_mean']:.3g}, top-1 agreement "
                                         f"{logits['top1_agreement']:.3f} ({logits['top1_near_ties']} near ties within "
                                         f"{limits['logit_tie_gap']:g} nats)"))
    return failures


NOT_MEASURED = "checks not measured"


def not_measured(report: StageReport, code: str, check: str, reason: str, how: str = "") -> None:
    """Say that stage 5 did not check ``check`` and why: a ``not-measured-<code>`` warning and a row of the
    report's "checks not measured" table (one place listing everything stage 5 left unchecked)."""
    report.tables.setdefault(NOT_MEASURED, []).append(
        {"check": check, "status": "not measured", "reason": reason, "how": how})
    report.add("warn", f"not-measured-{code}", f"{check}: not measured here; {reason}")


def run_family_precision(model_dir: Path, adapted: Adapted, limits: dict[str, float], layer_ids, faults,
                         report_dir) -> StageReport:
    """Stage 5 for the families the decoder engine does not build (qwen3_next, llama4: adapt.runtime.families).

    Reference: the family's torch path in float32 (tests/runtime/test_hybrid_vs_transformers.py and
    test_multimodal_vs_transformers.py prove it equal to transformers). Adapted: the same path with
    weights and compute in ``adapted.dtype`` (the only switch that runtime has). Measured and gated:
    per-layer hidden-state relative error (all rows), KL, top-1, top-5, perplexity on the bundled sample,
    greedy first divergence. What it cannot measure is reported as a "not measured here" warning.
    faults: only ``expert_scale`` applies (to the adapted model's weights)."""
    from adapt.runtime.families import family_forward, family_greedy, load_family_model
    from adapt.runtime.variants import FAULTS_ENV

    if faults.any and (faults.indexer_sign or faults.drop_yarn_mscale or faults.kv_scale is not None):
        raise InputError(f"fault {faults.describe()!r} hooks into the decoder engine, which this family does not "
                         "use", field=FAULTS_ENV, hint="use expert_scale=L:E:F for qwen3_next and llama4")
    dtype = _dtype(adapted.dtype)
    spec_model = load_family_model(model_dir, layer_ids, torch.float32)
    text, prompts = _encode(model_dir, spec_model.spec.vocab)
    greedy = int(limits["greedy_tokens"])
    continuations = [family_greedy(spec_model, p, greedy) for p in prompts]
    sequences = [text] + [p + c for p, c in zip(prompts, continuations, strict=True)]
    ref = [family_forward(spec_model, seq) for seq in sequences]
    del spec_model
    ad_model = load_family_model(model_dir, layer_ids, dtype, faults.expert_scale)
    ad = [family_forward(ad_model, seq) for seq in sequences]
    ref_logits, ad_logits = [r[0] for r in ref], [a[0] for a in ad]

    layer_rows, first = [], None
    for n, layer in enumerate(ad_model.layer_ids):
        error = _rel(torch.cat([a[1][n] for a in ad]), torch.cat([r[1][n] for r in ref]))
        first = first if first is not None else max(error, 1e-30)
        layer_rows.append({"layer": layer, "rel_error": error, "rel_error_all_rows": error, "growth": error / first})
    logits = compare_logits(ref_logits, ad_logits)
    ppl_ref, ppl_ad = perplexity(ref_logits[0], text), perplexity(ad_logits[0], text)
    greedy_rows = [{"prompt": i, **greedy_divergence(ref_logits[i + 1], ad_logits[i + 1], len(p), c,
                                                      limits["logit_tie_gap"])}
                   for i, (p, c) in enumerate(zip(prompts, continuations, strict=True))]
    failures = []
    worst_layer = max((r["rel_error"] for r in layer_rows), default=0.0)
    if worst_layer > limits["max_rel_error_layer"]:
        failures.append(("layer-error", f"largest per-layer relative error {worst_layer:.3g} > "
                                        f"{limits['max_rel_error_layer']:g}"))
    if logits["kl_mean"] > limits["max_kl"]:
        failures.append(("kl", f"KL(ref||adapted) {logits['kl_mean']:.3g} > {limits['max_kl']:g}"))
    if logits["top1_agreement"] < limits["min_top1_agreement"]:
        failures.append(("top1", f"top-1 agreement {logits['top1_agreement']:.3f} < {limits['min_top1_agreement']:g}"))
    if logits["top5_overlap"] < limits["min_top5_overlap"]:
        failures.append(("top5", f"top-5 overlap {logits['top5_overlap']:.3f} < {limits['min_top5_overlap']:g}"))
    increase = ppl_ad / ppl_ref - 1
    if increase > limits["max_ppl_increase"]:
        failures.append(("perplexity", f"perplexity {ppl_ad:.3f} vs reference {ppl_ref:.3f} "
                                       f"(+{increase:.2%} > {limits['max_ppl_increase']:.2%})"))
    short = [r for r in greedy_rows if r["diverged"] and not r["near_tie"]
             and r["matched"] < limits["min_greedy_match_tokens"]]
    if short:
        failures.append(("greedy", f"{len(short)} prompt(s) diverge for real before "
                                   f"{int(limits['min_greedy_match_tokens'])} tokens"))

    family = ad_model.spec.model_type
    report = StageReport(stage="precision", number=5, title="Precision alignment")
    report.metrics = {"adapted": adapted.__dict__, "family": family, "path": "adapt.runtime.families (torch)",
                      "reference": f"{family} torch path, float32", "device": "cpu",
                      "layers": layer_ids or "all", "max_rel_error_layer": worst_layer,
                      "error_growth_last_over_first": layer_rows[-1]["growth"] if layer_rows else None, **logits,
                      "perplexity_reference": ppl_ref, "perplexity_adapted": ppl_ad,
                      "greedy_min_matched": min(r["matched"] for r in greedy_rows)}
    if faults.any:
        report.metrics["injected_faults"] = faults.describe()
    report.tables["per-layer hidden-state error"] = layer_rows
    report.tables["greedy continuation per prompt"] = greedy_rows
    if report_dir is not None:
        png = plot_layers(layer_rows, Path(report_dir) / "precision_layers.png",
                          f"{model_dir.name}: {family} adapted ({adapted.dtype}) vs float32 reference")
        report.artifacts["layer_error_plot"] = png.name
        report.metrics["layer_error_plot"] = str(png)
    why = f"the {family} reference runtime (adapt.runtime.families) has no such switch or hook"
    unmeasured = [
        ("routing", "routing agreement and flips per MoE layer", "the family runtime does not expose its router "
                    "choices"),
        ("experts", "per-expert gain and relative error", "the family runtime has no per-expert forward hook (an "
                    "expert fault shows only through the layer and logits metrics)"),
        ("reference-anchor", "reference vs transformers logits", "the family's runtime tests compare it with "
                             "transformers in float32"),
    ]
    if adapted.kernels != "none":
        unmeasured.append(("kernels", f"adapt's Triton kernels ({adapted.kernels})",
                           f"{why}, so the adapted path is torch in {adapted.dtype}"))
    if adapted.weights != "as-stored":
        unmeasured.append(("expert-format", f"experts as {adapted.weights}", why))
    if adapted.kv_dtype != "bf16":
        unmeasured.append(("kv-cache", f"KV cache as {adapted.kv_dtype}", why))
    if family == "llama4":
        unmeasured.append(("image-input", "image input", "stage 5 feeds the bundled text only"))
    for code, check, reason in unmeasured:
        not_measured(report, code, check, reason)
    for code, message in failures:
        report.add("error", code, message)
    report.summary = (f"{len(failures)} precision gate(s) failed" if failures else
                      f"{family}: logits-level and per-layer metrics within their gates; {len(unmeasured)} "
                      "metric group(s) not measured here")
    return report
