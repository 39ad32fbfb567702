"""Reference path for hybrid linear-attention models (Qwen3-Next): Gated DeltaNet layers with a
gated full-attention layer every few layers, softmax top-k MoE with a gated shared expert.

A compact torch implementation, written from the architecture's definition (ModelSpec supplies
every size), that keeps one sequence's state between steps:

  linear layer   conv state [conv_dim, kernel - 1] (the last inputs of the causal depthwise conv)
                 and recurrent state [value heads, key dim, value dim] (the delta-rule memory);
                 both constant in the sequence length
  full layer     K and V [kv heads, tokens, head dim], growing with the sequence

Gated delta rule, per value head and token t (q, k L2-normalised, q scaled by key_dim^-1/2):
  S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
with g_t = -exp(A_log) softplus(a_t + dt_bias) and beta_t = sigmoid(b_t). Prefill runs the same
recurrence token by token (the chunked form is an equal rewrite of it); decode runs one step.
Norms are Qwen3-Next's zero-centred RMSNorm (x * (1 + w)); the linear layers' output norm is a
plain RMSNorm times silu(z). Everything runs in float32 unless ``dtype`` says otherwise.

Weights: a model directory's safetensors under the names transformers' Qwen3NextForCausalLM
uses (experts fused as ``mlp.experts.gate_up_proj`` [E, 2 x width, hidden] and
``mlp.experts.down_proj`` [E, hidden, width], or per expert as in the published checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from adapt.errors import InputError
from adapt.model.spec import AttentionSpec, FFNSpec, ModelSpec
from adapt.runtime.reference import ReferenceModel


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with weight 1 + w (Qwen3-Next), computed in float32. x [..., d], weight [d]."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * w * silu(gate) over the last dim (the linear layers' output norm)."""
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return (out * F.silu(gate.float())).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens, one value head per row (float32).

    q, k [T, H, dk] (already L2-normalised; q is scaled here by dk^-1/2), v [T, H, dv],
    g [T, H] (log decay), beta [T, H], state [H, dk, dv] -> (out [T, H, dv], new state).
    """
    q = q / (q.shape[-1] ** 0.5)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        remembered = (state * k[t][:, :, None]).sum(1)
        delta = (v[t] - remembered) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(1)
    return out, state


@dataclass
class HybridState:
    """One sequence's cache: per linear layer (conv state [conv_dim, kernel-1], recurrent state
    [Hv, dk, dv]); per full-attention layer K and V [kv heads, tokens, head dim]; tokens seen."""

    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0

    def state_bytes(self) -> int:
        """Bytes of the constant part (conv + recurrent states)."""
        return sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.recurrent.values()))


class HybridModel(ReferenceModel):
    """Qwen3-Next-style model on chosen decoder layers (reduced depth keeps each layer's own
    index, so its kind - linear or full attention, dense or MoE - is the one it has in full)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], layers: list[int] | None = None,
                 dtype: torch.dtype = torch.float32):
        if spec.model_type != "qwen3_next":
            raise InputError(f"the hybrid reference path runs qwen3_next, not {spec.model_type!r}",
                             file=spec.source, field="model_type")
        super().__init__(spec, weights, layers, dtype)
        self.eps = spec.norm_eps
        rope = spec.rope
        self.rotary_dim = rope.rotary_dim
        self.inv_freq = 1.0 / (rope.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32)
                                               / self.rotary_dim))

    # -------------------------------------------------------------- pieces

    def _experts(self, prefix: str, ffn: FFNSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2 x width, hidden], down [E, hidden, width]) from fused or per-expert tensors."""
        fused = self.w.get(prefix + "experts.gate_up_proj")
        if fused is not None:
            return fused, self._get(prefix + "experts.down_proj")
        gate_up = torch.stack([torch.cat([self._get(f"{prefix}experts.{e}.gate_proj.weight"),
                                          self._get(f"{prefix}experts.{e}.up_proj.weight")])
                               for e in range(ffn.num_experts)])
        down = torch.stack([self._get(f"{prefix}experts.{e}.down_proj.weight") for e in range(ffn.num_experts)])
        return gate_up, down

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        gate = x @ self._get(prefix + "gate_proj.weight").T
        up = x @ self._get(prefix + "up_proj.weight").T
        return (F.silu(gate) * up) @ self._get(prefix + "down_proj.weight").T

    def _ffn(self, prefix: str, ffn: FFNSpec, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: dense SwiGLU, or routed experts plus the gated shared expert."""
        if ffn.kind == "dense":
            return self._mlp(prefix + "mlp.", x)
        p = prefix + "mlp."
        probs = torch.softmax((x @ self._get(p + "gate.weight").T).float(), dim=-1)
        weights, chosen = torch.topk(probs, ffn.top_k, dim=-1)
        if ffn.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        gate_up, down = self._experts(p, ffn)
        out = torch.zeros_like(x)
        for slot in range(ffn.top_k):
            for e in chosen[:, slot].unique().tolist():
                rows = (chosen[:, slot] == e).nonzero().squeeze(1)
                gate, up = (x[rows] @ gate_up[e].T).chunk(2, dim=-1)
                out.index_add_(0, rows, ((F.silu(gate) * up) @ down[e].T) * weights[rows, slot, None])
        if ffn.num_shared_experts:
            shared = self._mlp(p + "shared_expert.", x)
            if ffn.shared_gate:
                shared = torch.sigmoid(x @ self._get(p + "shared_expert_gate.weight").T) * shared
            out = out + shared
        return out

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Partial rotary on the first rotary_dim dims (halves rotated). x [T, heads, head_dim]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(x.dtype)[:, None, :]
        sin = torch.cat([freqs.sin(), freqs.sin()], -1).to(x.dtype)[:, None, :]
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        half = rot.shape[-1] // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
        return torch.cat([rot * cos + rotated * sin, rest], -1)

    def _full_attention(self, i: int, a: AttentionSpec, x: torch.Tensor, state: HybridState) -> torch.Tensor:
        """Gated GQA with q/k zero-centred RMSNorm and partial RoPE; K/V appended to the cache."""
        p = f"model.layers.{i}.self_attn."
        t, hd = x.shape[0], a.head_dim
        q_gate = (x @ self._get(p + "q_proj.weight").T).view(t, a.num_heads, 2 * hd)
        q, gate = q_gate[..., :hd], q_gate[..., hd:].reshape(t, -1)
        k = (x @ self._get(p + "k_proj.weight").T).view(t, a.num_kv_heads, hd)
        v = (x @ self._get(p + "v_proj.weight").T).view(t, a.num_kv_heads, hd)
        q = zero_centred_rms_norm(q, self._get(p + "q_norm.weight"), self.eps)
        k = zero_centred_rms_norm(k, self._get(p + "k_norm.weight"), self.eps)
        positions = torch.arange(state.length, state.length + t)
        q, k = self._rope(q, positions), self._rope(k, positions)
        keys = torch.cat([state.keys[i], k.transpose(0, 1)], 1) if i in state.keys else k.transpose(0, 1)
        values = torch.cat([state.values[i], v.transpose(0, 1)], 1) if i in state.values else v.transpose(0, 1)
        state.keys[i], state.values[i] = keys, values
        group = a.num_heads // a.num_kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) * hd ** -0.5  # [heads, t, total]
        total = keys.shape[1]
        causal = torch.arange(total)[None, :] > (torch.arange(t) + state.length)[:, None]
        scores = scores.masked_fill(causal, float("-inf"))
        out = (torch.softmax(scores.float(), -1).to(x.dtype) @ values).transpose(0, 1).reshape(t, -1)
        return (out * torch.sigmoid(gate)) @ self._get(p + "o_proj.weight").T

    def _linear_attention(self, i: int, a: AttentionSpec, x: torch.Tensor, state: HybridState) -> torch.Tensor:
        """Gated DeltaNet: projections (grouped per key head, as the checkpoints store them),
        causal depthwise conv with SiLU over [q, k, v], the gated delta rule, gated RMSNorm."""
        p = f"model.layers.{i}.linear_attn."
        t = x.shape[0]
        hk, hv, dk, dv = a.linear_key_heads, a.linear_value_heads, a.linear_key_dim, a.linear_value_dim
        per = hv // hk
        qkvz = (x @ self._get(p + "in_proj_qkvz.weight").T).view(t, hk, 2 * dk + 2 * per * dv)
        ba = (x @ self._get(p + "in_proj_ba.weight").T).view(t, hk, 2 * per)
        q, k, v, z = torch.split(qkvz, [dk, dk, per * dv, per * dv], dim=-1)
        b, a_ = torch.split(ba, [per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)  # [t, conv_dim]
        weight = self._get(p + "conv1d.weight").squeeze(1)  # [conv_dim, kernel]
        width = weight.shape[1]
        history = state.conv.get(i, torch.zeros(mixed.shape[1], width - 1, dtype=x.dtype))
        padded = torch.cat([history, mixed.T], 1)  # [conv_dim, kernel - 1 + t]
        state.conv[i] = padded[:, -(width - 1):]
        conv = F.silu(F.conv1d(padded[None], weight[:, None, :], groups=weight.shape[0])[0]).T  # [t, conv_dim]
        q, k, v = torch.split(conv, [hk * dk, hk * dk, hv * dv], dim=-1)
        q = l2_normalize(q.reshape(t, hk, dk).float()).repeat_interleave(per, 1)
        k = l2_normalize(k.reshape(t, hk, dk).float()).repeat_interleave(per, 1)
        v = v.reshape(t, hv, dv).float()
        beta = torch.sigmoid(b.reshape(t, hv)).float()
        g = -self._get(p + "A_log").float().exp() * F.softplus(a_.reshape(t, hv).float()
                                                                + self._get(p + "dt_bias").float())
        memory = state.recurrent.get(i, torch.zeros(hv, dk, dv, dtype=torch.float32))
        out, state.recurrent[i] = gated_delta_rule(q, k, v, g, beta, memory)
        out = gated_rms_norm(out.to(x.dtype).reshape(-1, dv), z.reshape(-1, dv), self._get(p + "norm.weight"),
                             self.eps)
        return out.reshape(t, -1) @ self._get(p + "out_proj.weight").T

    # -------------------------------------------------------------- forward

    def forward(self, tokens: list[int], state: HybridState) -> torch.Tensor:
        """Run ``tokens`` after what ``state`` holds; returns fp32 logits [len(tokens), vocab]."""
        x = self._get("model.embed_tokens.weight")[torch.tensor(tokens)]
        for i in self.layer_ids:
            layer = self.spec.layers[i]
            prefix = f"model.layers.{i}."
            h = zero_centred_rms_norm(x, self._get(prefix + "input_layernorm.weight"), self.eps)
            if layer.attention.kind == "linear":
                h = self._linear_attention(i, layer.attention, h, state)
            else:
                h = self._full_attention(i, layer.attention, h, state)
            x = x + h
            h = zero_centred_rms_norm(x, self._get(prefix + "post_attention_layernorm.weight"), self.eps)
            x = x + self._ffn(prefix, layer.ffn, h)
            if self.captured is not None:
                self.captured.append(x.float())
        state.length += len(tokens)
        x = zero_centred_rms_norm(x, self._get("model.norm.weight"), self.eps)
        head = self.w.get("lm_head.weight", self._get("model.embed_tokens.weight"))
        return (x @ head.T).float()

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], HybridState]:
        """Greedy tokens after ``prompt`` (prefill once, then one decode step per token)."""
        state = HybridState()
        logits = self.forward(prompt, state)
        out: list[int] = []
        for _ in range(max_new_tokens):
            out.append(int(logits[-1].argmax()))
            logits = self.forward([out[-1]], state)
        return out, state
