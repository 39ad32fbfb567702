"""Checkpoint: safetensors headers only, hostile input as one-line InputErrors, grouping,
reduced-depth selection and the cross-check against a ModelSpec."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from adapt.errors import InputError
from adapt.model.checkpoint import (
    CHECKPOINT_COMPONENTS,
    DTYPE_BITS,
    INDEX_FILE,
    Checkpoint,
    component_of,
    expected_tensors,
    layer_of,
)
from adapt.model.spec import (
    AttentionSpec,
    FFNSpec,
    LayerSpec,
    ModelSpec,
    QuantFormat,
    QuantSpec,
    RopeSpec,
)

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- writers


def header_bytes(entries: dict) -> bytes:
    return json.dumps(entries).encode()


def write_raw(path: Path, header: bytes, data_bytes: int = 0, declared: int | None = None) -> Path:
    """A file: u64 header length (``declared`` overrides it), the header, ``data_bytes`` zero bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header) if declared is None else declared))
        fh.write(header)
        fh.truncate(8 + len(header) + data_bytes)
    return path


def write_shard(
    path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], metadata: dict | None = None
) -> Path:
    """A valid header-only shard: tensors packed in order, the data area left sparse."""
    entries: dict = {"__metadata__": metadata} if metadata is not None else {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * DTYPE_BITS[dtype] // 8
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return write_raw(path, header_bytes(entries), offset)


def write_index(directory: Path, weight_map: dict) -> Path:
    path = directory / INDEX_FILE
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def write_model(directory: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], shards: int = 2) -> Path:
    """Tensors split round-robin over ``shards`` files, with an index."""
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        write_shard(directory / shard, part)
        weight_map.update(dict.fromkeys(part, shard))
    write_index(directory, weight_map)
    return directory


def expected_as_files(spec: ModelSpec) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors a spec implies, as (dtype, shape) for the writers (BF16 where any dtype fits)."""
    return {name: (e.dtype or "BF16", e.shape) for name, e in expected_tensors(spec).items()}


# ---------------------------------------------------------------- specs built by hand from configs


def quant(method: str = "bf16", block=None, scale=None, per=None, not_converted=()) -> QuantSpec:
    return QuantSpec(
        default=QuantFormat(method, block, scale),
        per_component=per or {},
        modules_to_not_convert=tuple(not_converted),
    )


def deepseek_spec(
    *,
    layers=61,
    dense=3,
    hidden=7168,
    heads=128,
    experts=256,
    moe_width=2048,
    dense_width=18432,
    vocab=129280,
    q_lora=1536,
    kv_lora=512,
    dsa=True,
    mtp=1,
    quantization=None,
    model_type="deepseek_v32",
) -> ModelSpec:
    """DeepSeek-V3.2 by default (values from ../shared/configs/DeepSeek-V3.2/config.json)."""
    att = AttentionSpec(
        "mla+dsa" if dsa else "mla",
        heads,
        heads,
        192,
        128,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        index_n_heads=64 if dsa else 0,
        index_head_dim=128 if dsa else 0,
    )
    moe = FFNSpec(
        "moe",
        num_experts=experts,
        top_k=8,
        expert_intermediate=moe_width,
        num_shared_experts=1,
        shared_intermediate=moe_width,
        correction_bias=True,
        scoring="sigmoid",
    )
    main = tuple(
        LayerSpec(i, att, FFNSpec("dense", intermediate=dense_width) if i < dense else moe)
        for i in range(layers)
    )
    extra = tuple(LayerSpec(layers + i, att, moe, is_mtp=True) for i in range(mtp))
    return ModelSpec(
        model_type,
        "test",
        hidden,
        vocab,
        False,
        163840,
        1e-6,
        "bfloat16",
        RopeSpec("yarn", 1e4),
        quantization or quant("fp8_block", (128, 128), "ue8m0"),
        main,
        extra,
    )


def gqa_spec(
    model_type: str,
    *,
    layers,
    hidden,
    heads,
    kv_heads,
    head_dim,
    experts,
    width,
    vocab,
    qk_norm=False,
    bias=False,
    sinks=False,
    router_bias=False,
    dense_layers=(),
    dense_width=0,
    quantization=None,
    tie=False,
) -> ModelSpec:
    att = AttentionSpec("gqa", heads, kv_heads, head_dim, head_dim, qk_norm=qk_norm, bias=bias, sinks=sinks)
    moe = FFNSpec("moe", num_experts=experts, top_k=2, expert_intermediate=width, bias=router_bias)
    main = tuple(
        LayerSpec(i, att, FFNSpec("dense", intermediate=dense_width) if i in dense_layers else moe)
        for i in range(layers)
    )
    return ModelSpec(
        model_type,
        "test",
        hidden,
        vocab,
        tie,
        4096,
        1e-6,
        "bfloat16",
        RopeSpec("default", 1e6),
        quantization or quant(),
        main,
    )


def gpt_oss_120b() -> ModelSpec:
    """Values from ../shared/configs/gpt-oss-120b/config.json."""
    return gqa_spec(
        "gpt_oss",
        layers=36,
        hidden=2880,
        heads=64,
        kv_heads=8,
        head_dim=64,
        experts=128,
        width=2880,
        vocab=201088,
        bias=True,
        sinks=True,
        router_bias=True,
        quantization=quant("bf16", per={"routed_experts": QuantFormat("mxfp4", None, "e8m0")}),
    )


# ---------------------------------------------------------------- reading valid files


def test_real_safetensors_file_spans_point_at_the_tensor_bytes(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    tensors = {
        "model.embed_tokens.weight": torch.arange(24, dtype=torch.bfloat16).reshape(6, 4),
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.arange(3, dtype=torch.float32),
        "model.layers.0.self_attn.q_a_proj.weight": torch.ones(2, 4).to(torch.float8_e4m3fn),
        "packed": torch.zeros(2, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ckpt = Checkpoint.open(tmp_path)
    assert set(ckpt.tensors) == set(tensors)
    assert ckpt.shards[0].metadata == {"format": "pt"}
    emb = ckpt.tensors["model.embed_tokens.weight"]
    assert (emb.dtype, emb.shape, emb.shard) == ("BF16", (6, 4), "model.safetensors")
    assert ckpt.tensors["model.layers.0.self_attn.q_a_proj.weight"].dtype == "F8_E4M3"
    packed = ckpt.tensors["packed"]
    assert (packed.dtype, packed.shape, packed.nbytes) == ("F4", (2, 8), 8)
    raw = (tmp_path / "model.safetensors").read_bytes()
    for name, value in tensors.items():
        info = ckpt.tensors[name]
        assert raw[info.file_start : info.file_end] == value.contiguous().view(torch.uint8).numpy().tobytes()
    assert ckpt.total_bytes == sum(t.nbytes for t in ckpt.tensors.values()) == 6 * 4 * 2 + 12 + 8 + 8


def test_index_directory_reads_every_shard_and_reports_progress(tmp_path):
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": ("BF16", (4, 8)) for i in range(5)}
    write_model(tmp_path, tensors, shards=3)
    (tmp_path / "consolidated.safetensors").write_bytes(b"not listed in the index, so never read")
    calls = []
    ckpt = Checkpoint.open(tmp_path, progress=lambda done, total, name: calls.append((done, total, name)))
    assert ckpt.index_file == tmp_path / INDEX_FILE
    assert len(ckpt.tensors) == 5 and len(ckpt.shards) == 3
    assert [c[:2] for c in calls] == [(1, 3), (2, 3), (3, 3)]
    assert calls[0][2] == "model-00001-of-00003.safetensors"
    assert ckpt.total_bytes == 5 * 4 * 8 * 2


def test_directory_without_index_reads_every_safetensors_file(tmp_path):
    write_shard(tmp_path / "b.safetensors", {"lm_head.weight": ("BF16", (8, 4))})
    write_shard(tmp_path / "a.safetensors", {"model.embed_tokens.weight": ("BF16", (8, 4))})
    ckpt = Checkpoint.open(tmp_path)
    assert [s.name for s in ckpt.shards] == ["a.safetensors", "b.safetensors"]
    assert ckpt.tensors["lm_head.weight"].shard == "b.safetensors"


def test_hugging_face_cache_snapshot_links_into_blobs_are_allowed(tmp_path):
    repo = tmp_path / "models--org--name"
    blob = write_shard(repo / "blobs" / "0123abcd", {"lm_head.weight": ("BF16", (2, 2))})
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(blob, snapshot))
    assert Checkpoint.open(snapshot).tensors["lm_head.weight"].shape == (2, 2)


def test_zero_sized_tensors_share_an_offset(tmp_path):
    write_shard(tmp_path / "m.safetensors", {"a": ("F32", (0, 4)), "b": ("F32", (2,)), "c": ("I64", (0,))})
    assert Checkpoint.open(tmp_path).total_bytes == 8


# ---------------------------------------------------------------- bad and hostile input


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _one(tmp: Path, header: bytes, data: int = 8, declared=None, name="model.safetensors"):
    write_raw(tmp / name, header, data, declared)


def _index_case(tmp: Path, shard_name: str):
    write_shard(tmp / "model-1.safetensors", {"w": ("F32", (2,))})
    write_index(tmp, {"w": shard_name})


def _symlink_escape(tmp: Path):
    outside = tmp.parent / f"{tmp.name}-outside"
    write_shard(outside / "evil.safetensors", {"w": ("F32", (2,))})
    (tmp / "model-1.safetensors").symlink_to(outside / "evil.safetensors")
    write_index(tmp, {"w": "model-1.safetensors"})


def _deep_json(tmp: Path):
    _one(tmp, b"[" * 100_000 + b"]" * 100_000)


HOSTILE = {
    "short_file": (
        lambda t: (t / "model.safetensors").write_bytes(b"\x01\x02"),
        "model.safetensors",
        "too short for the 8-byte header length",
    ),
    "header_over_100MiB": (
        lambda t: _one(t, b"{}", declared=101 * 2**20),
        "model.safetensors",
        "exceeds the 100 MiB limit",
    ),
    "header_past_end": (
        lambda t: _one(t, b"{}", data=0, declared=5000),
        "model.safetensors",
        "runs past the end of the file",
    ),
    "invalid_json": (
        lambda t: _one(t, b'{"w": {"dtype": "F32",', data=0),
        "model.safetensors",
        "not valid JSON",
    ),
    "not_utf8": (lambda t: _one(t, b'{"\xff\xfe": 1}', data=0), "model.safetensors", "not UTF-8"),
    "deeply_nested_json": (_deep_json, "model.safetensors", "not valid JSON"),
    "header_is_a_list": (lambda t: _one(t, b"[1, 2]", data=0), "model.safetensors", "expected an object"),
    "unknown_dtype": (
        lambda t: _one(t, header_bytes({"w": _entry(dtype="F12")})),
        "model.safetensors",
        "tensor 'w': unknown dtype 'F12'",
    ),
    "negative_dim": (
        lambda t: _one(t, header_bytes({"w": _entry(shape=(-2,))})),
        "model.safetensors",
        "tensor 'w': shape [-2] is not a list",
    ),
    "bad_offsets": (
        lambda t: _one(t, header_bytes({"w": _entry(offsets=(8, 0))})),
        "model.safetensors",
        "tensor 'w': data_offsets [8, 0]",
    ),
    "offsets_not_ints": (
        lambda t: _one(t, header_bytes({"w": _entry(offsets=("0", 8))})),
        "model.safetensors",
        "is not [begin, end] integers",
    ),
    "offsets_outside_data": (
        lambda t: _one(t, header_bytes({"w": _entry(offsets=(0, 8))}), data=4),
        "model.safetensors",
        "end outside the data area (4 bytes)",
    ),
    "size_mismatch": (
        lambda t: _one(t, header_bytes({"w": _entry(shape=(3,))})),
        "model.safetensors",
        "shape [3] x F32 is 12 bytes but data_offsets span 8 bytes",
    ),
    "overlap": (
        lambda t: _one(t, header_bytes({"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(4, 12))}), data=12),
        "model.safetensors",
        "tensor 'b' [4, 12] overlaps tensor 'a' [0, 8]",
    ),
    "gap": (
        lambda t: _one(
            t, header_bytes({"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(12, 20))}), data=20
        ),
        "model.safetensors",
        "gap of 4 bytes after tensor 'a', before tensor 'b'",
    ),
    "trailing_bytes": (
        lambda t: _one(t, header_bytes({"a": _entry()}), data=16),
        "model.safetensors",
        "8 trailing bytes",
    ),
    "duplicate_name_in_header": (
        lambda t: _one(
            t, b'{"w": %s, "w": %s}' % (json.dumps(_entry()).encode(), json.dumps(_entry()).encode())
        ),
        "model.safetensors",
        "tensor 'w' twice",
    ),
    "duplicate_name_beside_metadata": (
        lambda t: _one(t, b'{"__metadata__": {}, "w": %s, "w": %s}' % ((json.dumps(_entry()).encode(),) * 2)),
        "model.safetensors",
        "tensor 'w' twice",
    ),
    "duplicate_name_escaped": (
        lambda t: _one(t, b'{"w": %s, "\\u0077": %s}' % ((json.dumps(_entry()).encode(),) * 2)),
        "model.safetensors",
        "tensor 'w' twice",
    ),
    "metadata_not_strings": (
        lambda t: _one(t, header_bytes({"__metadata__": {"a": 1}}), data=0),
        "model.safetensors",
        "'__metadata__' must map strings to strings",
    ),
    "newline_in_name": (
        lambda t: _one(t, header_bytes({"evil\nname": _entry(dtype="X")})),
        "model.safetensors",
        "tensor 'evil\\nname': unknown dtype",
    ),
    "duplicate_across_shards": (
        lambda t: (
            write_shard(t / "a.safetensors", {"w": ("F32", (2,))}),
            write_shard(t / "b.safetensors", {"w": ("F32", (2,))}),
        ),
        "b.safetensors",
        "tensor 'w' is also in shard 'a.safetensors'",
    ),
    "index_dotdot": (lambda t: _index_case(t, "../secret.safetensors"), INDEX_FILE, "contains '..'"),
    "index_absolute": (lambda t: _index_case(t, "/etc/passwd"), INDEX_FILE, "is an absolute path"),
    "index_symlink_escape": (_symlink_escape, INDEX_FILE, "symlink that leads outside the model directory"),
    "index_shard_missing": (
        lambda t: _index_case(t, "model-2.safetensors"),
        INDEX_FILE,
        "shard 'model-2.safetensors' is listed but missing",
    ),
    "index_invalid_json": (
        lambda t: (t / INDEX_FILE).write_text("{weight_map"),
        INDEX_FILE,
        "not valid JSON",
    ),
    "index_without_weight_map": (
        lambda t: (t / INDEX_FILE).write_text('{"weight_map": []}'),
        INDEX_FILE,
        "no 'weight_map' object",
    ),
    "index_value_not_string": (
        lambda t: (t / INDEX_FILE).write_text('{"weight_map": {"w": 3}}'),
        INDEX_FILE,
        "tensor 'w' maps to 3",
    ),
    "index_names_absent_tensor": (
        lambda t: (
            write_shard(t / "m.safetensors", {"w": ("F32", (2,))}),
            write_index(t, {"w": "m.safetensors", "v": "m.safetensors"}),
        ),
        INDEX_FILE,
        "lists tensor 'v' in 'm.safetensors' but that shard does not",
    ),
    "shard_tensor_not_in_index": (
        lambda t: (
            write_shard(t / "m.safetensors", {"w": ("F32", (2,)), "v": ("F32", (2,))}),
            write_index(t, {"w": "m.safetensors"}),
        ),
        "m.safetensors",
        "tensor 'v' is not listed in model.safetensors.index.json",
    ),
    "empty_directory": (lambda t: None, "", "no *.safetensors files"),
}


def _build_hostile(case: str, tmp_path: Path) -> tuple[Path, str, str]:
    build, file_part, problem = HOSTILE[case]
    model = tmp_path / "model"
    model.mkdir()
    build(model)
    return model, file_part, problem


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_checkpoint_is_one_line_input_error(case, tmp_path):
    model, file_part, problem = _build_hostile(case, tmp_path)
    with pytest.raises(InputError) as caught:
        Checkpoint.open(model)
    line = caught.value.line()
    assert "\n" not in line
    assert str(model) in line and file_part in line
    assert problem in line


def test_missing_path_is_input_error(tmp_path):
    with pytest.raises(InputError, match="no such file or directory"):
        Checkpoint.open(tmp_path / "absent")


TINY_MIXTRAL_CONFIG = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
CLI_CASES = sorted(set(HOSTILE) - {"empty_directory"})  # without shards `adapt info` reads the config only


def _cli_case(case: str, tmp_path: Path) -> tuple[Path, str, str, Path]:
    model, file_part, problem = _build_hostile(case, tmp_path)
    (model / "config.json").write_text(json.dumps(TINY_MIXTRAL_CONFIG))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return model, file_part, problem, cwd


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_info_on_hostile_checkpoint_exits_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    from adapt import cli

    model, file_part, problem, cwd = _cli_case(case, tmp_path)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["adapt", "info", str(model)])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.err + captured.out).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert problem in lines[0] and file_part in lines[0]
    assert not (cwd / "reports").exists()


def test_cli_process_on_hostile_checkpoint_exits_2(tmp_path):
    model, file_part, problem, cwd = _cli_case("overlap", tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "adapt.cli", "info", str(model)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400"},
        timeout=120,
    )
    assert done.returncode == 2
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    assert len(lines) == 1 and problem in lines[0] and file_part in lines[0]
    assert "Traceback" not in done.stderr
    assert not (cwd / "reports").exists()


# ---------------------------------------------------------------- grouping


@pytest.mark.parametrize(
    "name, component",
    [
        ("model.embed_tokens.weight", "embeddings"),
        ("lm_head.weight", "lm_head"),
        ("model.norm.weight", "norms"),
        ("model.layers.3.input_layernorm.weight", "norms"),
        ("model.layers.3.self_attn.kv_a_layernorm.weight", "attention"),
        ("model.layers.3.self_attn.q_b_proj.weight", "attention"),
        ("model.layers.3.self_attn.sinks", "attention"),
        ("model.layers.3.self_attn.q_b_proj.weight_scale_inv", "scales"),
        ("model.layers.3.self_attn.indexer.wk.weight", "indexer"),
        ("model.layers.3.self_attn.indexer.k_norm.bias", "indexer"),
        ("model.layers.3.mlp.gate.weight", "router"),
        ("model.layers.3.mlp.gate.e_score_correction_bias", "router"),
        ("model.layers.3.mlp.router.bias", "router"),
        ("model.layers.3.block_sparse_moe.gate.weight", "router"),
        ("model.layers.3.mlp.gate_proj.weight", "dense_mlp"),
        ("model.layers.3.mlp.experts.17.down_proj.weight", "routed_experts"),
        ("model.layers.3.block_sparse_moe.experts.1.w2.weight", "routed_experts"),
        ("model.layers.3.mlp.experts.gate_up_proj_blocks", "routed_experts"),
        ("model.layers.3.mlp.experts.gate_up_proj_scales", "scales"),
        ("model.layers.3.mlp.experts.5.gate_proj.weight_packed", "routed_experts"),
        ("model.layers.3.mlp.shared_experts.up_proj.weight", "shared_experts"),
        ("rotary.inv_freq", "other"),
    ],
)
def test_component_of(name, component):
    assert component_of(name) == component


def test_mtp_layer_tensors_count_as_mtp():
    assert component_of("model.layers.61.self_attn.o_proj.weight", {61}) == "mtp"
    assert component_of("model.layers.60.self_attn.o_proj.weight", {61}) == "attention"
    assert component_of("mtp.layers.0.mlp.gate.weight") == "mtp"
    assert layer_of("mtp.layers.0.mlp.gate.weight") == "mtp.0"
    assert layer_of("model.layers.12.mlp.gate.weight") == 12
    assert layer_of("model.norm.weight") is None


def tiny_deepseek_spec():
    """A 3-layer DeepSeek spec (1 dense layer, 4 experts, one MTP layer) small enough to write."""
    return deepseek_spec(
        layers=3,
        dense=1,
        hidden=256,
        heads=2,
        experts=4,
        moe_width=128,
        dense_width=384,
        vocab=512,
        q_lora=128,
        kv_lora=64,
        mtp=1,
    )


def tiny_deepseek_files() -> dict[str, tuple[str, tuple[int, ...]]]:
    return expected_as_files(tiny_deepseek_spec())


def test_bytes_by_component_and_layer(tmp_path):
    files = tiny_deepseek_files()
    ckpt = Checkpoint.open(write_model(tmp_path, files, shards=3))
    assert ckpt.mtp_layers == {3}
    by_component = ckpt.bytes_by_component()
    assert set(by_component) == set(CHECKPOINT_COMPONENTS)
    assert sum(by_component.values()) == ckpt.total_bytes

    def size(name):
        dtype, shape = files[name]
        return math.prod(shape) * DTYPE_BITS[dtype] // 8

    assert by_component["embeddings"] == size("model.embed_tokens.weight") == 512 * 256 * 2
    # routed experts of layers 1 and 2: 4 experts x 3 fp8 matrices of 128 x 256
    assert by_component["routed_experts"] == 2 * 4 * 3 * 128 * 256
    # fp8 block scales: one fp32 (here BF16 in the writer) per 128 x 128 block, MTP layer excluded
    main_scales = [n for n in files if n.endswith("weight_scale_inv") and not n.startswith("model.layers.3.")]
    assert by_component["scales"] == sum(size(n) for n in main_scales)
    assert by_component["mtp"] == sum(size(n) for n in files if n.startswith("model.layers.3."))
    by_layer = ckpt.bytes_by_layer()
    assert by_layer[0] == sum(size(n) for n in files if n.startswith("model.layers.0."))
    assert by_layer["lm_head"] == 512 * 256 * 2
    assert by_layer["norms"] == 256 * 2
    assert sum(by_layer.values()) == ckpt.total_bytes


# ---------------------------------------------------------------- select


def test_select_count_and_explicit_layers(tmp_path):
    ckpt = Checkpoint.open(write_model(tmp_path, tiny_deepseek_files()))
    two = ckpt.select(2)
    assert two.layers == (0, 1)
    assert {layer_of(n) for n in two.tensors} == {None, 0, 1}
    assert "lm_head.weight" in two.tensors and "model.norm.weight" in two.tensors
    picked = ckpt.select([2, 0])
    assert picked.layers == (0, 2)
    assert {layer_of(n) for n in picked.tensors} == {None, 0, 2}
    assert picked.total_bytes == ckpt.total_bytes - ckpt.bytes_by_layer()[1] - ckpt.bytes_by_layer()[3]
    assert ckpt.select(3).layers == (0, 1, 2)  # a count never includes the MTP layer
    with_mtp = ckpt.select([0, 3])
    assert with_mtp.bytes_by_component()["mtp"] == ckpt.bytes_by_component()["mtp"]


@pytest.mark.parametrize(
    "layers, message",
    [
        (0, "cannot select 0 layers"),
        (4, "cannot select 4 layers"),
        ([0, 9], "layers [9] are not in the checkpoint"),
    ],
)
def test_select_out_of_range_is_input_error(tmp_path, layers, message):
    ckpt = Checkpoint.open(write_model(tmp_path, tiny_deepseek_files()))
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ckpt.select(layers)


# ---------------------------------------------------------------- expected tensors vs published counts


def _params(expected) -> int:
    """Logical parameters: packed MXFP4 blocks count two per byte; quantization scales none."""
    total = 0
    for name, e in expected.items():
        if name.endswith(("_scale_inv", "_scales")):
            continue
        total += math.prod(e.shape) * (2 if name.endswith("_blocks") else 1)
    return total


def test_deepseek_v32_expected_parameters_match_published_count():
    # ../shared/configs/README.md: 685,355,329,792 parameters as stored (MTP layer included)
    assert _params(expected_tensors(deepseek_spec())) == 685_355_329_792


def test_gpt_oss_120b_expected_bytes_and_parameters_match_published():
    expected = expected_tensors(gpt_oss_120b())
    assert _params(expected) == 116_829_156_672
    # MXFP4 blocks and scales 1 byte per element, everything else bf16: 65,248,815,744 bytes
    stored = sum(math.prod(e.shape) * (1 if e.dtype == "U8" else 2) for e in expected.values())
    assert stored == 65_248_815_744


def test_qwen3_and_mixtral_expected_parameters_match_published():
    qwen = gqa_spec(
        "qwen3_moe",
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        experts=128,
        width=768,
        vocab=151936,
        qk_norm=True,
    )
    assert _params(expected_tensors(qwen)) == 30_532_122_624
    mixtral = gqa_spec(
        "mixtral",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        experts=8,
        width=14336,
        vocab=32000,
    )
    assert _params(expected_tensors(mixtral)) == 46_702_792_704


# ---------------------------------------------------------------- check_against


def test_check_against_matching_checkpoint_has_no_findings(tmp_path):
    spec = tiny_deepseek_spec()
    ckpt = Checkpoint.open(write_model(tmp_path, expected_as_files(spec)))
    assert ckpt.check_against(spec) == []
    assert ckpt.select([0, 2]).check_against(spec) == []


def test_check_against_reports_missing_unexpected_misshaped_and_wrong_dtype(tmp_path):
    spec = tiny_deepseek_spec()
    files = expected_as_files(spec)
    del files["model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"]
    files["model.layers.1.self_attn.kv_b_proj.weight"] = ("F8_E4M3", (256, 32))
    files["model.layers.0.mlp.down_proj.weight"] = ("BF16", (256, 384))
    files["model.layers.0.rotary_emb.inv_freq"] = ("F32", (32,))
    ckpt = Checkpoint.open(write_model(tmp_path, files))
    found = {(f.severity, f.code): f.message for f in ckpt.check_against(spec)}
    assert set(found) == {
        ("error", "checkpoint.missing_tensor"),
        ("error", "checkpoint.shape_mismatch"),
        ("error", "checkpoint.dtype_mismatch"),
        ("warn", "checkpoint.unexpected_tensor"),
    }
    assert (
        "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"
        in found["error", "checkpoint.missing_tensor"]
    )
    assert "[256, 32]" in found["error", "checkpoint.shape_mismatch"]
    assert "[512, 64]" in found["error", "checkpoint.shape_mismatch"]
    assert "is BF16" in found["error", "checkpoint.dtype_mismatch"]
    assert "rotary_emb.inv_freq" in found["warn", "checkpoint.unexpected_tensor"]
    # a selection that leaves out the broken layers sees only what is wrong in layer 0
    codes = {f.code for f in ckpt.select([0]).check_against(spec)}
    assert codes == {"checkpoint.dtype_mismatch", "checkpoint.unexpected_tensor"}


def test_check_against_caps_findings_per_code(tmp_path):
    spec = tiny_deepseek_spec()
    files = {n: f for n, f in expected_as_files(spec).items() if ".experts." not in n}
    findings = Checkpoint.open(write_model(tmp_path, files)).check_against(spec, limit=5)
    missing = [f for f in findings if f.code == "checkpoint.missing_tensor"]
    assert len(missing) == 6
    assert missing[-1].message.startswith(f"... and {3 * 4 * 3 * 2 - 5} more")


def test_check_against_unknown_family_warns(tmp_path):
    write_shard(tmp_path / "m.safetensors", {"w": ("F32", (2,))})
    spec = gqa_spec(
        "llama4_text", layers=1, hidden=8, heads=2, kv_heads=1, head_dim=4, experts=2, width=8, vocab=16
    )
    [finding] = Checkpoint.open(tmp_path).check_against(spec)
    assert (finding.severity, finding.code) == ("warn", "checkpoint.unknown_family")


def test_int4_and_not_converted_modules(tmp_path):
    spec = deepseek_spec(
        layers=2,
        dense=1,
        hidden=256,
        heads=2,
        experts=2,
        moe_width=128,
        dense_width=256,
        vocab=64,
        q_lora=128,
        kv_lora=64,
        dsa=False,
        mtp=0,
        model_type="kimi_k2",
        quantization=quant(
            "bf16",
            per={"routed_experts": QuantFormat("int4", (1, 32), "bf16")},
            not_converted=["model.layers.*.mlp.experts.1"],
        ),
    )
    expected = expected_tensors(spec)
    packed = expected["model.layers.1.mlp.experts.0.gate_proj.weight_packed"]
    assert (packed.shape, packed.dtype) == ((128, 32), "I32")
    assert expected["model.layers.1.mlp.experts.0.down_proj.weight_scale"].shape == (256, 4)
    assert expected["model.layers.1.mlp.experts.1.down_proj.weight"].shape == (256, 128)
    assert "model.layers.1.mlp.experts.1.down_proj.weight_packed" not in expected


# ---------------------------------------------------------------- against checkpoints transformers writes

# Sizes every tiny model shares (transformers config keys)
_TINY_COMMON = dict(
    hidden_size=32,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=64,
)
TINY_CONFIGS = {
    "qwen3_moe": dict(
        _TINY_COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_key_value_heads=2,
        head_dim=8,
        mlp_only_layers=[1],
    ),
    "mixtral": dict(_TINY_COMMON, intermediate_size=16, num_local_experts=4, num_key_value_heads=2),
    "deepseek_v3": dict(
        _TINY_COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "gpt_oss": dict(
        _TINY_COMMON, intermediate_size=16, num_local_experts=4, num_key_value_heads=2, head_dim=8
    ),
}
# The same sizes in gqa_spec's terms, for the GQA families of TINY_CONFIGS
_TINY_GQA = dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, experts=4, width=16, vocab=64)


def tiny_spec(model_type: str) -> ModelSpec:
    """The ModelSpec of TINY_CONFIGS[model_type], written out by hand."""
    fp32 = quant("fp32")
    if model_type == "deepseek_v3":
        att = AttentionSpec(
            "mla", 4, 4, 12, 8, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4
        )
        moe = FFNSpec(
            "moe",
            num_experts=4,
            top_k=2,
            expert_intermediate=16,
            num_shared_experts=1,
            shared_intermediate=16,
            correction_bias=True,
        )
        layers = (LayerSpec(0, att, FFNSpec("dense", intermediate=48)), LayerSpec(1, att, moe))
        return ModelSpec(
            "deepseek_v3",
            "tiny",
            32,
            64,
            False,
            4096,
            1e-6,
            "float32",
            RopeSpec("default", 1e4),
            fp32,
            layers,
        )
    if model_type == "qwen3_moe":
        return gqa_spec(
            "qwen3_moe",
            **_TINY_GQA,
            qk_norm=True,
            dense_layers=(1,),
            dense_width=48,
            quantization=fp32,
        )
    if model_type == "mixtral":
        return gqa_spec("mixtral", **_TINY_GQA, quantization=fp32)
    return gqa_spec(
        "gpt_oss",
        **_TINY_GQA,
        bias=True,
        sinks=True,
        router_bias=True,
        quantization=fp32,
    )


@pytest.fixture(scope="module")
def transformers_checkpoints(tmp_path_factory):
    """Tiny random models of each family saved by transformers' own save_pretrained."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    out = {}
    for model_type, kwargs in TINY_CONFIGS.items():
        directory = tmp_path_factory.mktemp(model_type)
        config = AutoConfig.for_model(model_type, tie_word_embeddings=False, **kwargs)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="20KB")
        out[model_type] = directory
    return out


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_check_against_checkpoint_saved_by_transformers(model_type, transformers_checkpoints):
    ckpt = Checkpoint.open(transformers_checkpoints[model_type])
    assert len(ckpt.shards) > 1
    assert ckpt.check_against(tiny_spec(model_type)) == []
    assert ckpt.select([1]).check_against(tiny_spec(model_type)) == []


@pytest.mark.parametrize("preset", ["deepseek-v3.2", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_expected_tensors_from_loaded_presets_match_hand_built_specs(preset):
    from adapt.model.spec import load_spec

    hand = {
        "deepseek-v3.2": deepseek_spec(),
        "gpt-oss-120b": gpt_oss_120b(),
        "qwen3-30b-a3b": gqa_spec(
            "qwen3_moe",
            layers=48,
            hidden=2048,
            heads=32,
            kv_heads=4,
            head_dim=128,
            experts=128,
            width=768,
            vocab=151936,
            qk_norm=True,
        ),
        "mixtral-8x7b": gqa_spec(
            "mixtral",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            experts=8,
            width=14336,
            vocab=32000,
        ),
    }[preset]
    assert expected_tensors(load_spec(preset)) == expected_tensors(hand)
