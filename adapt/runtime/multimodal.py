"""Reference path for a multimodal MoE (Llama 4): the tiled ViT, its pixel-shuffle adapter and
projector, and the language model with interleaved dense / MoE layers, chunked local attention
on RoPE layers and full attention on NoPE layers. Written from the architecture's definition;
ModelSpec supplies every size.

Vision, per 336-pixel tile (tiny models: ``image_size``): unfold into p x p patches, a linear
patch embedding, a CLS token appended last, learned positions, LayerNorm, ViT blocks (LayerNorm,
bidirectional attention with 2D rotary on patch column and row, GELU MLP), LayerNorm, drop the
CLS token, pixel shuffle (2x2 patches -> one token), adapter MLP (GELU after each linear), and
the projector into the language width. Image features replace the ``<|patch|>`` placeholder
embeddings in prompt order.

Language model, per layer: RMSNorm; attention with complex (interleaved-pair) RoPE and a
parameter-free q/k L2 norm on RoPE layers, which attend only within their chunk of
``attention_chunk_size`` tokens; NoPE layers attend causally to everything, their queries scaled
by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)); then RMSNorm and either a SwiGLU or
the MoE: top-k of the router logits, sigmoid of the chosen scores multiplying the expert's
*input*, plus one shared expert. Greedy decoding keeps K/V per layer.

Weights: the directory's safetensors under transformers' Llama4ForConditionalGeneration names
(``language_model.model.*``, ``vision_model.*``, ``multi_modal_projector.*``) or the same names
under ``model.`` as transformers 5 saves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
import torch.nn.functional as F

from adapt.errors import InputError
from adapt.model.spec import AttentionSpec, FFNSpec, ModelSpec, load_spec
from adapt.runtime.reference import ReferenceModel


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / rms(x) (float32 inside) times weight (None: no weight, the L2 norm of Llama 4's q/k)."""
    out = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if weight is None else out * weight


def rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x [..., T, heads, d] by angles [T, d/2] (float32 inside)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotation = torch.polar(torch.ones_like(angles), angles)[..., None, :]
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """[tiles, side*side, c] -> [tiles, (side*ratio)^2, c / ratio^2], Llama 4's patch merge."""
    tiles, patches, channels = x.shape
    side = int(patches ** 0.5)
    x = x.view(tiles, side, int(side * ratio), int(channels / ratio))
    x = x.permute(0, 2, 1, 3).reshape(tiles, int(side * ratio), int(side * ratio), int(channels / ratio ** 2))
    return x.permute(0, 2, 1, 3).reshape(tiles, -1, int(channels / ratio ** 2))


@dataclass
class MultimodalState:
    """K and V per language layer [kv heads, tokens, head dim] and the tokens seen."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0


class MultimodalModel(ReferenceModel):
    """Llama 4 multimodal MoE on chosen language layers (each keeps its own index and kind)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], layers: list[int] | None = None,
                 dtype: torch.dtype = torch.float32):
        if spec.model_type != "llama4" or spec.vision is None:
            raise InputError(f"the multimodal reference path runs llama4 with a vision tower, not {spec.model_type!r}",
                             file=spec.source, field="model_type")
        super().__init__(spec, weights, layers, dtype)
        text = spec.config.get("text_config", {})
        self.attn_scale = float(text.get("attn_scale", 0.1))
        self.floor_scale = float(text.get("floor_scale", 8192))
        self.temperature_tuning = bool(text.get("attn_temperature_tuning", True))
        head_dim = spec.layers[0].attention.head_dim
        self.inv_freq = self._text_inv_freq(head_dim)
        self.image_token = int(spec.config.get("image_token_index", spec.config.get("image_token_id", -1)))
        self.vision_angles = self._vision_angles()

    @staticmethod
    def _canonical(name: str) -> str:
        """transformers 5's "model.language_model.X" / "model.vision_model.X" -> the checkpoint names."""
        for old, new in (("model.language_model.", "language_model.model."), ("model.vision_model.", "vision_model."),
                         ("model.multi_modal_projector.", "multi_modal_projector."),
                         ("lm_head.", "language_model.lm_head.")):
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def _text_inv_freq(self, head_dim: int) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim/2], with Llama 3 scaling when the config asks for it."""
        rope = self.spec.rope
        inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if rope.type != "llama3":
            return inv
        low, high = float(rope.extra.get("low_freq_factor", 1.0)), float(rope.extra.get("high_freq_factor", 4.0))
        original, factor = rope.original_max_position, rope.factor
        wavelen = 2 * torch.pi / inv
        smooth = (original / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > original / low, inv / factor, inv)
        middle = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(middle, (1 - smooth) * scaled / factor + smooth * scaled, scaled)

    # -------------------------------------------------------------- vision

    def _vision_angles(self) -> torch.Tensor:
        """2D rotary angles [patches + 1, head_dim / 2]: column then row frequencies (positions
        counted from 1), interleaved; the CLS token (last) is not rotated."""
        v = self.spec.vision
        side = v.image_size // v.patch_size
        index = torch.arange(side * side)
        freq_dim = v.hidden // v.heads // 2
        freqs = 1.0 / (10000.0 ** (torch.arange(0, freq_dim, 2)[: freq_dim // 2].float() / freq_dim))
        theta = float(self.spec.config.get("vision_config", {}).get("rope_theta", 10000.0))
        if theta != 10000.0:
            freqs = 1.0 / (theta ** (torch.arange(0, freq_dim, 2)[: freq_dim // 2].float() / freq_dim))
        x = ((index % side + 1)[:, None] * freqs[None, :]).repeat_interleave(2, -1)
        y = ((index // side + 1)[:, None] * freqs[None, :]).repeat_interleave(2, -1)
        angles = torch.cat([x, y], -1)[:, ::2]
        return torch.cat([angles, torch.zeros(1, angles.shape[1])])

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [tiles, 3, size, size] (normalised) -> language-width features
        [tiles x tokens per tile, hidden] in the order the placeholders take them."""
        v, p = self.spec.vision, "vision_model."
        x = F.unfold(pixel_values.to(self.dtype), kernel_size=v.patch_size, stride=v.patch_size).transpose(1, 2)
        x = x @ self._get(p + "patch_embedding.linear.weight").T
        cls = self._get(p + "class_embedding").expand(x.shape[0], 1, -1)
        x = torch.cat([x, cls], 1) + self._get(p + "positional_embedding_vlm")
        x = F.layer_norm(x, (v.hidden,), self._get(p + "layernorm_pre.weight"), self._get(p + "layernorm_pre.bias"))
        head_dim = v.hidden // v.heads
        for n in range(v.layers):
            b = f"{p}model.layers.{n}."

            def lin(name: str, h: torch.Tensor, b: str = b) -> torch.Tensor:
                return h @ self._get(f"{b}{name}.weight").T + self._get(f"{b}{name}.bias")

            h = F.layer_norm(x, (v.hidden,), self._get(b + "input_layernorm.weight"),
                             self._get(b + "input_layernorm.bias"))
            tiles, tokens = h.shape[:2]
            q = rotate_pairs(lin("self_attn.q_proj", h).view(tiles, tokens, v.heads, head_dim), self.vision_angles)
            k = rotate_pairs(lin("self_attn.k_proj", h).view(tiles, tokens, v.heads, head_dim), self.vision_angles)
            val = lin("self_attn.v_proj", h).view(tiles, tokens, v.heads, head_dim)
            scores = torch.einsum("tqhd,tkhd->thqk", q, k) * head_dim ** -0.5  # bidirectional
            attn = torch.einsum("thqk,tkhd->tqhd", torch.softmax(scores, -1), val).reshape(tiles, tokens, -1)
            x = x + lin("self_attn.o_proj", attn)
            h = F.layer_norm(x, (v.hidden,), self._get(b + "post_attention_layernorm.weight"),
                             self._get(b + "post_attention_layernorm.bias"))
            x = x + lin("mlp.fc2", F.gelu(lin("mlp.fc1", h)))
        x = F.layer_norm(x, (v.hidden,), self._get(p + "layernorm_post.weight"), self._get(p + "layernorm_post.bias"))
        x = pixel_shuffle(x[:, :-1], 1.0 / v.merge[0])
        x = F.gelu(x @ self._get(p + "vision_adapter.mlp.fc1.weight").T)
        x = F.gelu(x @ self._get(p + "vision_adapter.mlp.fc2.weight").T)
        x = x.reshape(-1, x.shape[-1]) @ self._get("multi_modal_projector.linear_1.weight").T
        bias = self.w.get("multi_modal_projector.linear_1.bias")
        return x if bias is None else x + bias

    # -------------------------------------------------------------- language model

    def _attention(self, i: int, a: AttentionSpec, x: torch.Tensor, state: MultimodalState) -> torch.Tensor:
        p = f"language_model.model.layers.{i}.self_attn."
        t, hd = x.shape[0], a.head_dim
        q = (x @ self._get(p + "q_proj.weight").T).view(t, a.num_heads, hd)
        k = (x @ self._get(p + "k_proj.weight").T).view(t, a.num_kv_heads, hd)
        v = (x @ self._get(p + "v_proj.weight").T).view(t, a.num_kv_heads, hd)
        positions = torch.arange(state.length, state.length + t)
        if a.rope:
            angles = positions.float()[:, None] * self.inv_freq[None, :]
            q, k = rotate_pairs(q, angles), rotate_pairs(k, angles)
        if a.qk_l2norm:
            q, k = rms_norm(q, None, self.spec.norm_eps), rms_norm(k, None, self.spec.norm_eps)
        if self.temperature_tuning and not a.rope:
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scale[:, None, None]).to(q.dtype)
        keys = torch.cat([state.keys[i], k.transpose(0, 1)], 1) if i in state.keys else k.transpose(0, 1)
        values = torch.cat([state.values[i], v.transpose(0, 1)], 1) if i in state.values else v.transpose(0, 1)
        state.keys[i], state.values[i] = keys, values
        group = a.num_heads // a.num_kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) * hd ** -0.5
        kv_pos = torch.arange(keys.shape[1])[None, :]
        blocked = kv_pos > positions[:, None]
        if a.chunk:
            blocked |= (kv_pos // a.chunk) != (positions[:, None] // a.chunk)
        scores = scores.masked_fill(blocked, float("-inf"))
        out = (torch.softmax(scores.float(), -1).to(x.dtype) @ values).transpose(0, 1).reshape(t, -1)
        return out @ self._get(p + "o_proj.weight").T

    def _swiglu(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        gate, up = x @ self._get(prefix + "gate_proj.weight").T, x @ self._get(prefix + "up_proj.weight").T
        return (F.silu(gate) * up) @ self._get(prefix + "down_proj.weight").T

    def _ffn(self, i: int, ffn: FFNSpec, x: torch.Tensor) -> torch.Tensor:
        p = f"language_model.model.layers.{i}.feed_forward."
        if ffn.kind == "dense":
            return self._swiglu(p, x)
        logits = x @ self._get(p + "router.weight").T
        top, chosen = torch.topk(logits, ffn.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)
        gate_up, down = self._get(p + "experts.gate_up_proj"), self._get(p + "experts.down_proj")
        out = self._swiglu(p + "shared_expert.", x)
        for slot in range(ffn.top_k):
            for e in chosen[:, slot].unique().tolist():
                rows = (chosen[:, slot] == e).nonzero().squeeze(1)
                gate, up = ((x[rows] * scores[rows, slot, None]) @ gate_up[e]).chunk(2, dim=-1)
                out = out.index_add(0, rows, (F.silu(gate) * up) @ down[e])
        return out

    def forward(self, tokens: list[int], state: MultimodalState,
                image_features: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``tokens`` after what ``state`` holds; ``image_features`` [n, hidden] replace the
        n image-placeholder tokens in order. Returns fp32 logits [len(tokens), vocab]."""
        ids = torch.tensor(tokens)
        x = self._get("language_model.model.embed_tokens.weight")[ids]
        slots = ids == self.image_token
        if image_features is not None or slots.any():
            if image_features is None or int(slots.sum()) != image_features.shape[0]:
                have = 0 if image_features is None else image_features.shape[0]
                raise InputError(f"the prompt has {int(slots.sum())} image placeholders for {have} image features",
                                 field="--image")
            x = x.clone()
            x[slots] = image_features.to(x.dtype)
        for i in self.layer_ids:
            layer = self.spec.layers[i]
            p = f"language_model.model.layers.{i}."
            x = x + self._attention(i, layer.attention, rms_norm(x, self._get(p + "input_layernorm.weight"),
                                                                 self.spec.norm_eps), state)
            x = x + self._ffn(i, layer.ffn, rms_norm(x, self._get(p + "post_attention_layernorm.weight"),
                                                     self.spec.norm_eps))
            if self.captured is not None:
                self.captured.append(x.float())
        state.length += len(tokens)
        x = rms_norm(x, self._get("language_model.model.norm.weight"), self.spec.norm_eps)
        return (x @ self._get("language_model.lm_head.weight").T).float()

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int,
                 pixel_values: torch.Tensor | None = None) -> list[int]:
        """Greedy tokens after ``prompt``; ``pixel_values`` [tiles, 3, size, size] fill its placeholders."""
        features = None if pixel_values is None else self.encode_images(pixel_values)
        state = MultimodalState()
        logits = self.forward(prompt, state, features)
        out: list[int] = []
        for _ in range(max_new_tokens):
            out.append(int(logits[-1].argmax()))
            logits = self.forward([out[-1]], state)
        return out

    def image_prompt(self) -> list[int]:
        """Token ids of one single-tile image in a prompt: the begin-of-image id, one placeholder
        per image token, the end-of-image id (ids from config.json, so no tokenizer is needed;
        the processor's extra <|image|> marker is a plain text token and left out)."""
        v = self.spec.vision
        per_tile = (v.image_size // v.patch_size) ** 2 // (v.merge[0] * v.merge[1])
        cfg = self.spec.config
        return [int(cfg["boi_token_index"])] + [self.image_token] * per_tile + [int(cfg["eoi_token_index"])]


def load_image_tile(path: str | Path, size: int, mean: float = 0.5, std: float = 0.5) -> torch.Tensor:
    """An image file as one normalised tile [1, 3, size, size]: RGB, resized (bilinear) to
    size x size, scaled to [0, 1], then (x - mean) / std (Llama 4's processor uses 0.5 / 0.5)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR)
    except (OSError, UnidentifiedImageError) as err:
        raise InputError(f"cannot read the image: {err}", file=str(path), field="--image") from None
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)) / 255.0  # [size, size, 3]
    return ((pixels - mean) / std).permute(2, 0, 1)[None]


class MoonViT(ReferenceModel):
    """Kimi K2.5's vision tower and projector (MoonViT + patch merger), images in, language-width
    features out (the language model is DeepSeek-V3's: ``KimiK25Model``).

    Per image of ph x pw patches (row-major): Conv patch embedding, plus the learned position grid
    resampled bicubically to (ph, pw); blocks of LayerNorm, bidirectional attention with 2D
    rotary on interleaved pairs (per frequency the column angle, then the row angle: the published
    layout, which transformers permutes into rotated halves when it loads), LayerNorm and a
    tanh-GELU MLP; final LayerNorm; each 2x2 window of patches concatenated (pre-normed) into one
    token; two linears with GELU between into the language width.
    Weights under the published checkpoint names (vision_tower.*, mm_projector.*).
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], layers: list[int] | None = None,
                 dtype: torch.dtype = torch.float32):
        if spec.model_type != "kimi_k25" or spec.vision is None:
            raise InputError(f"MoonViT runs kimi_k25's vision tower, not {spec.model_type!r}",
                             file=spec.source, field="model_type")
        super().__init__(spec, weights, layers, dtype)

    @classmethod
    def from_dir(cls, model_dir: str | Path, layers: list[int] | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> MoonViT:
        """Only the vision tower's and projector's tensors of ``model_dir``, on ``device`` (read one by
        one from the safetensors headers' byte spans: the language model's terabyte stays on disk)."""
        from adapt.runtime.weights import WeightStore

        store = WeightStore(model_dir, device=device)
        names = [n for n in store.checkpoint.tensors if n.startswith(("vision_tower.", "mm_projector."))]
        return cls(load_spec(model_dir), {n: store.get(n) for n in names}, layers, dtype)

    def _angles(self, ph: int, pw: int) -> torch.Tensor:
        """Rotary angles [ph * pw, head_dim / 2] of row-major patches: (column, row) per frequency."""
        v = self.spec.vision
        head_dim = v.hidden // v.heads
        theta = float(self.spec.config.get("vision_config", {}).get("rope_parameters", {}).get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)))
        rows, cols = torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing="ij")
        per_axis = torch.stack([rows.flatten(), cols.flatten()], -1)[..., None].float() * inv  # [N, 2, hd/4]
        return per_axis.transpose(1, 2).flip(-1).flatten(1)  # [N, hd/2]: col0, row0, col1, row1, ...

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """pixel_values [sum of ph*pw, 3, p, p] (row-major patches of each image, normalised);
        grids: (ph, pw) per image -> features [sum of ph*pw / 4, text hidden] in image order."""
        v, p = self.spec.vision, "vision_tower."
        weight = self._get(p + "patch_embed.proj.weight")
        x = F.conv2d(pixel_values.to(weight.device, self.dtype), weight,
                     self._get(p + "patch_embed.proj.bias"), stride=v.patch_size).flatten(1)
        table = self._get(p + "patch_embed.pos_emb.weight")  # [gh, gw, hidden]
        out, start = [], 0
        head_dim = v.hidden // v.heads
        for ph, pw in grids:
            h = x[start:start + ph * pw]
            start += ph * pw
            pos = table if (ph, pw) == tuple(table.shape[:2]) else F.interpolate(
                table.permute(2, 0, 1)[None], size=(ph, pw), mode="bicubic", align_corners=False)[0].permute(1, 2, 0)
            h = h + pos.reshape(ph * pw, -1)
            angles = self._angles(ph, pw).to(h.device)
            for n in range(v.layers):
                b = f"{p}encoder.blocks.{n}."
                y = F.layer_norm(h, (v.hidden,), self._get(b + "norm0.weight"), self._get(b + "norm0.bias"), 1e-5)
                qkv = y @ self._get(b + "wqkv.weight").T + self._get(b + "wqkv.bias")
                q, k, val = (t.reshape(-1, v.heads, head_dim) for t in qkv.chunk(3, -1))
                q, k = rotate_pairs(q, angles), rotate_pairs(k, angles)  # checkpoint layout: interleaved pairs
                scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim ** -0.5
                attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), val).reshape(ph * pw, -1)
                h = h + attn @ self._get(b + "wo.weight").T + self._get(b + "wo.bias")
                y = F.layer_norm(h, (v.hidden,), self._get(b + "norm1.weight"), self._get(b + "norm1.bias"), 1e-5)
                y = F.gelu(y @ self._get(b + "mlp.fc0.weight").T + self._get(b + "mlp.fc0.bias"), approximate="tanh")
                h = h + y @ self._get(b + "mlp.fc1.weight").T + self._get(b + "mlp.fc1.bias")
            h = F.layer_norm(h, (v.hidden,), self._get(p + "encoder.final_layernorm.weight"),
                             self._get(p + "encoder.final_layernorm.bias"), 1e-5)
            kh, kw = v.merge
            windows = h.view(ph // kh, kh, pw // kw, kw, -1).permute(0, 2, 1, 3, 4).reshape(-1, kh * kw, v.hidden)
            out.append(windows)
        merged = torch.cat(out)
        q = "mm_projector."
        y = F.layer_norm(merged, (v.hidden,), self._get(q + "pre_norm.weight"), self._get(q + "pre_norm.bias"), 1e-5)
        y = F.gelu(y.reshape(merged.shape[0], -1) @ self._get(q + "proj.0.weight").T + self._get(q + "proj.0.bias"))
        return y @ self._get(q + "proj.2.weight").T + self._get(q + "proj.2.bias")


def load_image_patches(path: str | Path | BinaryIO, spec: ModelSpec, mean: float = 0.5,
                       std: float = 0.5) -> tuple[torch.Tensor, tuple[int, int]]:
    """An image file (a path or an open binary file) as MoonViT's input: (patches [ph * pw, 3, p, p]
    row-major, (ph, pw)).

    As Kimi K2.5's processor does it: RGB; shrunk (bicubic) only when a side exceeds
    ``max_side_patches`` patches; zero-padded at the bottom and right to whole merge windows
    (p x merge pixels); scaled to [0, 1], then (x - mean) / std (0.5 / 0.5, so padding is -1).
    The processor's total cap (16384 patches) is not applied.
    """
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    v = spec.vision
    try:
        image = Image.open(path).convert("RGB")
    except (OSError, UnidentifiedImageError) as err:
        raise InputError(f"cannot read the image: {err}", file=str(path), field="--image") from None
    width, height = image.size
    scale = min(1.0, v.max_side_patches * v.patch_size / height, v.max_side_patches * v.patch_size / width)
    if scale < 1.0:
        width, height = max(1, int(width * scale)), max(1, int(height * scale))
        image = image.resize((width, height), Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)  # [3, H, W], 0..255
    step_h, step_w = v.patch_size * v.merge[0], v.patch_size * v.merge[1]
    pixels = F.pad(pixels, (0, -width % step_w, 0, -height % step_h))
    pixels = (pixels / 255.0 - mean) / std
    ph, pw = pixels.shape[1] // v.patch_size, pixels.shape[2] // v.patch_size
    patches = pixels.view(3, ph, v.patch_size, pw, v.patch_size).permute(1, 3, 0, 2, 4)
    return patches.reshape(ph * pw, 3, v.patch_size, v.patch_size), (ph, pw)


KIMI_MEDIA_IDS = (163602, 163605, 163604)
"""Kimi K2.5's <|media_begin|>, <|media_pad|> (the image placeholder) and <|media_end|> ids, for
configs that do not name them (transformers' Kimi_K25Config defaults)."""


class KimiK25Model:
    """Kimi K2.5 end to end: ``MoonViT`` encodes the images, adapt's decoder engine
    (adapt.runtime.engine: DeepSeek-V3 MLA + MoE, built from ModelSpec, under ``language_model.``)
    runs the language model over a paged cache.

    Prompts carry ONE image placeholder (``image_token_id``, <|media_pad|>) per image, as the chat
    template writes it; each is expanded to that image's (ph / 2) x (pw / 2) feature rows in
    prompt order, as the published modeling code (moonshotai/Kimi-K2.5 modeling_kimi_k25.py,
    ``_merge_input_ids_with_image_features`` at inference) and vLLM's prompt replacement do.
    """

    def __init__(self, vision: MoonViT, engine):
        self.vision, self.engine, self.spec = vision, engine, engine.spec
        cfg = self.spec.config  # the published config names it media_placeholder_token_id, transformers image_token_id
        self.image_token = int(cfg.get("image_token_id", cfg.get("media_placeholder_token_id", KIMI_MEDIA_IDS[1])))

    @classmethod
    def from_dir(cls, model_dir: str | Path, layers: list[int] | None = None, dtype: torch.dtype = torch.float32,
                 kernels: str = "none", max_tokens: int = 4096, device: str | torch.device = "cpu") -> KimiK25Model:
        """The vision tower and the chosen language layers (None: all) of ``model_dir`` in ``dtype`` on
        ``device``; ``kernels``: the language model's op families on adapt's kernels (``Engine.load``)."""
        from adapt.runtime.engine import Engine

        engine = Engine.load(model_dir, layers=layers, kernels=kernels, dtype=dtype, max_tokens=max_tokens,
                             device=device)
        return cls(MoonViT.from_dir(model_dir, dtype=dtype, device=device), engine)

    def prompt_logits(self, prompt: list[int], images: list[tuple[torch.Tensor, tuple[int, int]]]) -> torch.Tensor:
        """One prefill of ``prompt`` with ``images`` from an empty cache: fp32 logits [expanded tokens, vocab]."""
        tokens, embeddings = self.expand(list(prompt), self.encode_images(images))
        seq = self.engine.start(1)
        try:
            with torch.no_grad():
                return self.engine.step(seq, [tokens], embeddings=embeddings, all_logits=True)[0]
        finally:
            self.engine.release(seq)

    @property
    def layer_ids(self) -> list[int]:
        return [layer.index for layer in self.engine.model.layers]

    def expand(self, prompt: list[int], features: list[torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
        """(tokens with each image placeholder repeated once per feature row, input embeddings
        [len(tokens), hidden] with the features in those rows; None without images)."""
        count = sum(1 for t in prompt if t == self.image_token)
        if count != len(features):
            raise InputError(f"the prompt has {count} image placeholders for {len(features)} images", field="--image",
                             hint=f"one token {self.image_token} per image")
        if not features:
            return list(prompt), None
        model = self.engine.model
        embeddings = model.embed[torch.tensor(prompt, device=model.device)].to(model.dtype)
        pieces, tokens, images = [], [], iter(features)
        for position, token in enumerate(prompt):
            rows = next(images).to(model.dtype) if token == self.image_token else embeddings[position:position + 1]
            pieces.append(rows)
            tokens += [token] * rows.shape[0]
        return tokens, torch.cat(pieces)

    def encode_images(self, images: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """(patches [ph * pw, 3, p, p], (ph, pw)) per image -> features [ph * pw / 4, hidden] per image."""
        return [self.vision.encode_images(patches, [grid]) for patches, grid in images]

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int,
                 images: list[tuple[torch.Tensor, tuple[int, int]]] | None = None,
                 step_logits: list[torch.Tensor] | None = None) -> list[int]:
        """Greedy tokens after ``prompt`` (no stop id); ``images`` as ``encode_images`` takes them,
        one per placeholder of ``prompt``; ``step_logits``: a list that receives the fp32 logits
        [vocab] each token was chosen from."""
        tokens, embeddings = self.expand(list(prompt), self.encode_images(images or []))
        engine = self.engine
        seq = engine.start(1)
        out: list[int] = []
        try:
            logits = engine.step(seq, [tokens], embeddings=embeddings)[0]
            for step in range(max_new_tokens):
                out.append(int(logits.argmax()))
                if step_logits is not None:
                    step_logits.append(logits)
                if step + 1 < max_new_tokens:
                    logits = engine.step(seq, [[out[-1]]])[0]
        finally:
            engine.release(seq)
        return out

    def image_prompt(self) -> list[int]:
        """Token ids around one image in a prompt: the media begin id, the placeholder, the media end
        id (ids from config.json, so no tokenizer is needed; the chat template's "image" and
        <|media_content|> text tokens between begin and placeholder are left out)."""
        cfg = self.spec.config
        return [int(cfg.get("vision_start_token_id", KIMI_MEDIA_IDS[0])), self.image_token,
                int(cfg.get("vision_end_token_id", KIMI_MEDIA_IDS[2]))]
