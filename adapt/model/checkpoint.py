"""Checkpoint: the tensors of a safetensors model directory, read from the headers only.

A safetensors file is an 8-byte little-endian u64 ``N``, then ``N`` bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``),
then the data area; offsets are bytes relative to the start of the data area. This module
reads the first ``8 + N`` bytes of every shard and never touches tensor data, so the
headers of a 1 TB checkpoint read in seconds.

Every shard is checked as untrusted input: header length, JSON, dtypes, shapes, offsets,
exact tiling of the data area, and (through ``model.safetensors.index.json``) shard names
that must stay inside the model directory. Each failure is an ``InputError`` naming the file
and the tensor, one line, for the CLI to print with exit code 2.

``Checkpoint.check_against(spec)`` compares the tensors with the names and shapes a
``ModelSpec`` implies (families: deepseek_v3 / deepseek_v32 / kimi_k2, glm4_moe, gpt_oss,
qwen3_moe, mixtral), including fp8 ``weight_scale_inv``, int4 ``weight_packed`` and gpt-oss
MXFP4 ``*_blocks`` / ``*_scales`` tensors.
"""

from __future__ import annotations

import fnmatch
import json
import math
import operator
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from adapt.errors import InputError
from adapt.report import MAX_HEADER_BYTES, Finding

INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 100 * 2**20

# Storage bits per element of every dtype code the safetensors format defines
# (huggingface/safetensors Dtype enum; F4 / F6 are packed, the header shape counts elements).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

# Components: adapt.model.spec.COMPONENTS plus "scales" (quantization scale tensors of any
# component outside MTP layers) and "other" (anything unrecognised).
CHECKPOINT_COMPONENTS = (
    "embeddings", "lm_head", "attention", "indexer", "router", "routed_experts",
    "shared_experts", "dense_mlp", "norms", "scales", "mtp", "other",
    "linear_attention", "vision", "projector",
)

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SCALE_SUFFIXES = (".weight_scale_inv", "_scales", ".weight_scale", ".weight_scale_2", ".input_scale",
                   ".weight_zero_point", ".k_scale", ".v_scale")
_MTP_MARKERS = (".eh_proj.", ".enorm.", ".hnorm.", ".shared_head.")
_ROUTER_RE = re.compile(r"\.(?:gate|router)\.(?:weight|bias|e_score_correction_bias)$")
_MAX_NAME_CHARS = 160
_INT_ONLY = frozenset({int})
_SPAN = operator.itemgetter(4, 5)  # TensorInfo (start, end)


def _shown(text: str) -> str:
    """``text`` made safe for a one-line message: escapes control characters, caps the length."""
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    if len(text) > _MAX_NAME_CHARS:
        text = text[:_MAX_NAME_CHARS] + "..."
    return text


def _tensor(name: str) -> str:
    return f"tensor '{_shown(name)}'"


class TensorInfo(NamedTuple):
    """One tensor as its shard's header describes it.

    name: tensor name; dtype: safetensors dtype code ("BF16", "F8_E4M3", ...)
    shape: element counts per dimension (packed F4/F6: logical elements)
    shard: file name relative to the model directory
    start, end: byte span [start, end) relative to the shard's data area
    data_offset: absolute file offset of the shard's data area (8 + header length), bytes
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    start: int
    end: int
    data_offset: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def file_start(self) -> int:
        """Absolute byte offset of the tensor's first byte in its shard file."""
        return self.data_offset + self.start

    @property
    def file_end(self) -> int:
        """Absolute byte offset one past the tensor's last byte in its shard file."""
        return self.data_offset + self.end


@dataclass(frozen=True)
class ShardInfo:
    """One safetensors file: name relative to the directory, size in bytes, header length in
    bytes (N, without the 8-byte prefix), its tensor count and ``__metadata__``."""

    name: str
    file_bytes: int
    header_bytes: int
    tensor_count: int
    metadata: dict[str, str] = field(default_factory=dict)


ProgressCallback = Callable[[int, int, str], None]
"""progress(shards_done, shards_total, shard_name), called after each shard is read."""


def _json_object(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def read_shard_header(path: Path, shard: str) -> tuple[list[TensorInfo], ShardInfo]:
    """Parse and validate one safetensors file's header; ``shard`` is its name in the directory.

    Raises InputError (file = ``path``) for: a file shorter than 8 bytes, a header length over
    ``MAX_HEADER_BYTES`` or past the end of the file, bytes that are not UTF-8 JSON, a header
    that is not an object, duplicate names, bad ``__metadata__``, an entry without a valid
    dtype / shape / data_offsets, offsets outside the data area, shape x dtype size differing
    from the byte span, overlapping tensors, gaps between tensors, or trailing bytes.
    """
    where = _shown(str(path))
    try:
        file_bytes = os.stat(path).st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise InputError(f"file is {file_bytes} bytes, too short for the 8-byte header length",
                                 file=where)
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > MAX_HEADER_BYTES:
                raise InputError(f"header length {header_bytes:,} bytes exceeds the "
                                 f"{MAX_HEADER_BYTES // 2**20} MiB limit", file=where,
                                 hint="corrupt or not a safetensors file")
            if 8 + header_bytes > file_bytes:
                raise InputError(f"header length {header_bytes:,} bytes runs past the end of the file "
                                 f"({file_bytes:,} bytes)", file=where, hint="truncated download?")
            raw = fh.read(header_bytes)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", file=where) from None
    if len(raw) != header_bytes:
        raise InputError(f"header ends after {len(raw)} of {header_bytes} bytes", file=where)
    try:
        text = raw.decode("utf-8")
        header = json.loads(text)
        entries = len(header) - ("__metadata__" in header) if isinstance(header, dict) else 0
        if entries and (raw.count(b'"data_offsets"') > entries or b"\\u" in raw):
            # json.loads keeps the last of repeated keys: when an extra "data_offsets" key (or an
            # escape that could spell one) hints at a repeat, parse again watching for them
            json.loads(text, object_pairs_hook=_json_object)
    except UnicodeDecodeError as exc:
        raise InputError(f"header is not UTF-8 (byte {exc.start})", file=where) from None
    except _DuplicateKey as exc:
        raise InputError(f"header names {_tensor(exc.key)} twice", file=where) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"header is not valid JSON: {exc.msg} at byte {exc.pos}", file=where) from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"header is not valid JSON: {_shown(str(exc))}", file=where) from None
    if not isinstance(header, dict):
        raise InputError(f"header is a JSON {type(header).__name__}, expected an object", file=where)

    data_bytes = file_bytes - 8 - header_bytes
    data_offset = 8 + header_bytes
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InputError("'__metadata__' must map strings to strings", file=where)

    tensors: list[TensorInfo] = []
    append = tensors.append
    bits_of = DTYPE_BITS.get
    prod = math.prod
    for name, entry in header.items():
        try:
            dtype = entry["dtype"]
            shape = entry["shape"]
            start, end = entry["data_offsets"]
            valid = (type(dtype) is str and type(shape) is list and type(start) is int and type(end) is int
                     and 0 <= start <= end <= data_bytes
                     and (not shape or (min(shape) >= 0 and _INT_ONLY.issuperset(map(type, shape))))
                     and prod(shape) * bits_of(dtype) == (end - start) * 8)
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            _raise_entry_error(name, entry, data_bytes, where)
        append(TensorInfo(name, dtype, tuple(shape), shard, start, end, data_offset))

    _check_tiling(tensors, data_bytes, where)
    return tensors, ShardInfo(shard, file_bytes, header_bytes, len(tensors), metadata)


def _raise_entry_error(name: str, entry: object, data_bytes: int, where: str) -> None:
    """Raise the InputError that says what is wrong with one header entry."""
    if type(entry) is not dict:
        raise InputError(f"{_tensor(name)}: entry is not an object", file=where)
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
    if bits is None:
        raise InputError(f"{_tensor(name)}: unknown dtype {_shown(repr(dtype))}", file=where,
                         hint=f"known: {', '.join(DTYPE_BITS)}")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise InputError(f"{_tensor(name)}: shape {_shown(repr(shape))} is not a list of "
                         "non-negative integers", file=where)
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
            or type(offsets[1]) is not int):
        raise InputError(f"{_tensor(name)}: data_offsets {_shown(repr(offsets))} is not "
                         "[begin, end] integers", file=where)
    start, end = offsets
    if start < 0 or end < start:
        raise InputError(f"{_tensor(name)}: data_offsets [{start}, {end}] are not "
                         "0 <= begin <= end", file=where)
    if end > data_bytes:
        raise InputError(f"{_tensor(name)}: data_offsets [{start}, {end}] end outside the data "
                         f"area ({data_bytes:,} bytes)", file=where, hint="truncated download?")
    nbits = math.prod(shape) * bits
    size = f"{nbits // 8:,}" if nbits % 8 == 0 else f"{nbits / 8:,}"
    raise InputError(f"{_tensor(name)}: shape {shape} x {dtype} is {size} bytes but "
                     f"data_offsets span {end - start:,} bytes", file=where)


def _check_tiling(tensors: list[TensorInfo], data_bytes: int, where: str) -> None:
    """The byte spans must cover [0, data_bytes) exactly: no overlap, no gap, no trailing bytes."""
    position = 0
    previous: TensorInfo | None = None
    for t in sorted(tensors, key=_SPAN):
        if t.start < position:
            raise InputError(f"{_tensor(t.name)} [{t.start}, {t.end}] overlaps {_tensor(previous.name)} "
                             f"[{previous.start}, {previous.end}]", file=where)
        if t.start > position:
            after = f"after {_tensor(previous.name)}" if previous else "at the start of the data area"
            raise InputError(f"gap of {t.start - position:,} bytes {after}, before {_tensor(t.name)}",
                             file=where)
        position = t.end
        if t.end > t.start or previous is None:
            previous = t
    if position != data_bytes:
        after = f"after {_tensor(previous.name)}" if previous else "and no tensors"
        raise InputError(f"data area has {data_bytes - position:,} trailing bytes {after}", file=where,
                         hint="file longer than its header says")


def _allowed_roots(directory: Path) -> list[str]:
    """Real paths shard files may resolve into: the directory itself and, for a Hugging Face
    cache snapshot (``<repo>/snapshots/<rev>``), that repo's ``blobs`` folder its links point to."""
    real = os.path.realpath(directory)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def _resolve_shard(directory: Path, name: str, roots: list[str], where: str) -> Path:
    """The file a shard name refers to, refusing names that leave the model directory."""
    shown = _shown(name)
    if not name or "\x00" in name:
        raise InputError(f"shard name '{shown}' is empty or contains NUL", file=where)
    if os.path.isabs(name) or name.startswith(("\\", "/")):
        raise InputError(f"shard '{shown}' is an absolute path; shards must be inside the model directory",
                         file=where)
    if ".." in re.split(r"[\\/]", name):
        raise InputError(f"shard '{shown}' contains '..'; shards must be inside the model directory",
                         file=where)
    path = directory / name
    if not _inside(os.path.realpath(path), roots):
        raise InputError(f"shard '{shown}' is a symlink that leads outside the model directory",
                         file=where)
    if not path.exists():
        raise InputError(f"shard '{shown}' is listed but missing", file=where, hint="incomplete download?")
    if not path.is_file():
        raise InputError(f"shard '{shown}' is not a regular file", file=where)
    return path


def _read_index(index_path: Path) -> dict[str, str]:
    """weight_map of ``model.safetensors.index.json``: tensor name -> shard name."""
    where = _shown(str(index_path))
    try:
        size = index_path.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise InputError(f"index is {size:,} bytes, over the {MAX_INDEX_BYTES // 2**20} MiB limit",
                             file=where)
        index = json.loads(index_path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", file=where) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"index is not UTF-8 (byte {exc.start})", file=where) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"index is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                         file=where) from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"index is not valid JSON: {_shown(str(exc))}", file=where) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise InputError("index has no 'weight_map' object", file=where, field="weight_map")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise InputError(f"{_tensor(name)} maps to {_shown(repr(shard))}, expected a file name",
                             file=where, field="weight_map")
    return weight_map


class Checkpoint:
    """The tensors of a model directory, from safetensors headers only.

    directory: the model directory
    tensors: name -> TensorInfo (every shard's tensors, in shard order)
    shards: the shards read, in order
    index_file: model.safetensors.index.json when the directory has one
    layers: the decoder layer indices a ``select`` kept (None: the whole checkpoint)
    """

    def __init__(self, directory: Path, tensors: dict[str, TensorInfo], shards: tuple[ShardInfo, ...],
                 index_file: Path | None = None, layers: tuple[int, ...] | None = None):
        self.directory = directory
        self.tensors = tensors
        self.shards = shards
        self.index_file = index_file
        self.layers = layers

    @classmethod
    def open(cls, path: str | Path, progress: ProgressCallback | None = None) -> Checkpoint:
        """Read the headers of a model directory (or of one .safetensors file).

        Shards come from ``model.safetensors.index.json`` when present, else from every
        ``*.safetensors`` file in the directory. Raises InputError for every bad or hostile
        input (see ``read_shard_header`` and the index checks in the module docstring).
        """
        path = Path(path)
        if path.is_file():
            directory, names, weight_map, index_file = path.parent, [path.name], None, None
        elif path.is_dir():
            directory = path
            index_file = path / INDEX_FILE
            if index_file.exists():
                weight_map = _read_index(index_file)
                names = list(dict.fromkeys(weight_map.values()))
                if not names:
                    raise InputError("index 'weight_map' is empty", file=_shown(str(index_file)),
                                     field="weight_map")
            else:
                index_file, weight_map = None, None
                names = sorted(p.name for p in path.glob("*.safetensors"))
            if not names:
                raise InputError("no *.safetensors files and no model.safetensors.index.json",
                                 file=_shown(str(path)), hint="is this a model directory?")
        else:
            raise InputError("no such file or directory", file=_shown(str(path)))

        roots = _allowed_roots(directory)
        index_where = _shown(str(index_file)) if index_file else _shown(str(directory))
        files = [_resolve_shard(directory, name, roots, index_where) for name in names]

        tensors: dict[str, TensorInfo] = {}
        shards = []
        for number, (name, file) in enumerate(zip(names, files, strict=True), start=1):
            shard_tensors, shard = read_shard_header(file, name)
            by_name = {t.name: t for t in shard_tensors}
            if not tensors.keys().isdisjoint(by_name):
                repeated = next(n for n in by_name if n in tensors)
                raise InputError(f"{_tensor(repeated)} is also in shard '{_shown(tensors[repeated].shard)}'",
                                 file=_shown(str(file)))
            tensors.update(by_name)
            shards.append(shard)
            if progress is not None:
                progress(number, len(names), name)

        if weight_map is not None:
            _check_index_matches(weight_map, tensors, directory, index_where)
        return cls(directory, tensors, tuple(shards), index_file)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (headers excluded)."""
        return sum(t.end - t.start for t in self.tensors.values())

    @cached_property
    def mtp_layers(self) -> frozenset[int]:
        """Layer indices holding multi-token-prediction tensors (eh_proj, enorm, hnorm, shared_head)."""
        found = set()
        for name in self.tensors:
            if any(marker in name for marker in _MTP_MARKERS):
                index = layer_of(name)
                if isinstance(index, int):
                    found.add(index)
        return frozenset(found)

    @cached_property
    def layer_indices(self) -> tuple[int, ...]:
        """Sorted decoder layer indices present (MTP layers included)."""
        return tuple(sorted({i for i in map(layer_of, self.tensors) if isinstance(i, int)}))

    def component_of(self, name: str) -> str:
        """Component of a tensor of this checkpoint (one of CHECKPOINT_COMPONENTS)."""
        return component_of(name, self.mtp_layers)

    def bytes_by_component(self) -> dict[str, int]:
        """Tensor bytes per component, every CHECKPOINT_COMPONENTS key present (0 when absent)."""
        totals = dict.fromkeys(CHECKPOINT_COMPONENTS, 0)
        mtp = self.mtp_layers
        for t in self.tensors.values():
            totals[component_of(t.name, mtp)] += t.end - t.start
        return totals

    def bytes_by_layer(self) -> dict[int | str, int]:
        """Tensor bytes per decoder layer index (int); tensors outside layers under their
        component name ("embeddings", "lm_head", "norms", ...); ``mtp.<i>`` for ``mtp.layers.<i>``."""
        totals: dict[int | str, int] = {}
        mtp = self.mtp_layers
        for t in self.tensors.values():
            key = layer_of(t.name)
            if key is None:
                key = component_of(t.name, mtp)
            totals[key] = totals.get(key, 0) + t.end - t.start
        return totals

    def select(self, layers: int | Iterable[int]) -> Checkpoint:
        """Reduced-depth view: tensors outside decoder layers (embeddings, final norm, head) plus
        the chosen layers. ``layers``: a count N (layers 0..N-1) or explicit indices such as
        [0, 3, 60] (a DeepSeek model's first layers are dense). Raises InputError for a count
        out of range or an index the checkpoint lacks."""
        present = self.layer_indices
        where = _shown(str(self.directory))
        if not present:
            raise InputError("checkpoint has no decoder layers (no 'layers.<i>.' tensor names) to select",
                             file=where)
        if isinstance(layers, int) and not isinstance(layers, bool):
            main = [i for i in present if i not in self.mtp_layers]
            if not 1 <= layers <= len(main):
                raise InputError(f"cannot select {layers} layers: the checkpoint has {len(main)}",
                                 file=where, field="layers")
            chosen = tuple(main[:layers])
        else:
            chosen = tuple(sorted(set(layers)))
            missing = [i for i in chosen if i not in present]
            if missing or not chosen:
                raise InputError(f"layers {missing or '[]'} are not in the checkpoint (it has layers "
                                 f"{present[0]}-{present[-1]})", file=where, field="layers")
        keep = set(chosen)
        if self.layers is not None:
            keep &= set(self.layers)
        tensors = {name: t for name, t in self.tensors.items()
                   if (index := layer_of(name)) is None or index in keep}
        return Checkpoint(self.directory, tensors, self.shards, self.index_file, tuple(sorted(keep)))

    def check_against(self, spec, limit: int = 20) -> list[Finding]:
        """Compare with the tensors ``spec`` (an adapt.model.spec.ModelSpec) implies.

        Findings (code "checkpoint.*"): missing tensors (error), wrongly shaped tensors (error),
        unexpected dtype of a quantized tensor (error), unexpected tensors (warn), a model
        family whose naming adapt does not know (warn). After ``select``, only the kept layers
        are expected. At most ``limit`` findings per code, then one that counts the rest.
        """
        expected = expected_tensors(spec)
        if expected is None:
            return [Finding("warn", "checkpoint.unknown_family",
                            f"no tensor naming known for model_type '{spec.model_type}'; names not checked",
                            hint="supported: " + ", ".join(sorted(_FAMILIES)))]
        if self.layers is not None:
            keep = set(self.layers)
            expected = {name: e for name, e in expected.items()
                        if (index := layer_of(name)) is None or index in keep}
        problems: dict[str, list[Finding]] = {}

        def add(severity: str, code: str, message: str, hint: str = "") -> None:
            problems.setdefault(code, []).append(Finding(severity, code, message, hint))

        for name, want in expected.items():
            have = self.tensors.get(name)
            if have is None:
                if not want.optional:
                    add("error", "checkpoint.missing_tensor", f"{_tensor(name)} expected by the config is "
                        f"missing", hint=f"expected shape {list(want.shape)}")
                continue
            if have.shape != want.shape:
                add("error", "checkpoint.shape_mismatch", f"{_tensor(name)} in '{_shown(have.shard)}' has "
                    f"shape {list(have.shape)}, the config implies {list(want.shape)}")
            if want.dtype is not None and have.dtype != want.dtype:
                add("error", "checkpoint.dtype_mismatch", f"{_tensor(name)} in '{_shown(have.shard)}' is "
                    f"{have.dtype}, the quantization config implies {want.dtype}")
        for name, have in self.tensors.items():
            if name not in expected:
                add("warn", "checkpoint.unexpected_tensor",
                    f"{_tensor(name)} in '{_shown(have.shard)}' is not implied by the config")

        findings: list[Finding] = []
        for code, items in problems.items():
            findings.extend(items[:limit])
            if len(items) > limit:
                findings.append(Finding(items[0].severity, code, f"... and {len(items) - limit:,} more "
                                        f"{code.removeprefix('checkpoint.').replace('_', ' ')} findings"))
        return findings


def _check_index_matches(weight_map: dict[str, str], tensors: dict[str, TensorInfo],
                         directory: Path, where: str) -> None:
    """Every tensor the index names is in that shard, and every shard tensor is in the index."""
    if {name: t.shard for name, t in tensors.items()} == weight_map:
        return
    for name, shard in weight_map.items():
        have = tensors.get(name)
        if have is None or have.shard != shard:
            raise InputError(f"index lists {_tensor(name)} in '{_shown(shard)}' but that shard does "
                             "not have it", file=where, hint="index and shards are from different revisions?")
    if len(tensors) != len(weight_map):
        for name, t in tensors.items():
            if name not in weight_map:
                raise InputError(f"{_tensor(name)} is not listed in {INDEX_FILE}",
                                 file=_shown(str(directory / t.shard)))


def layer_of(name: str) -> int | str | None:
    """Decoder layer of a tensor name: the int in ``layers.<i>.``; ``"mtp.<i>"`` for names under
    a top-level ``mtp.`` module; None outside layers."""
    match = _LAYER_RE.search(name)
    if match is None:
        return None
    if name.startswith("mtp."):
        return f"mtp.{match.group(1)}"
    return int(match.group(1))


def component_of(name: str, mtp_layers: Iterable[int] = frozenset()) -> str:
    """Component of a tensor name (one of CHECKPOINT_COMPONENTS). ``mtp_layers``: layer indices
    that are multi-token-prediction layers (everything in them is "mtp")."""
    if name.startswith("mtp."):
        return "mtp"
    if mtp_layers:
        index = layer_of(name)
        if index in mtp_layers:
            return "mtp"
    if name.endswith(_SCALE_SUFFIXES):
        return "scales"
    multimodal = _multimodal_component(name)
    if multimodal is not None:
        return multimodal
    if ".indexer." in name:
        return "indexer"
    if ".self_attn." in name or ".attn." in name or ".attention." in name:
        return "attention"
    if _ROUTER_RE.search(name):
        return "router"
    if ".shared_expert" in name:
        return "shared_experts"
    if ".experts." in name:
        return "routed_experts"
    if ".mlp." in name or ".feed_forward." in name or ".block_sparse_moe." in name:
        return "dense_mlp"
    if "embed_tokens" in name or name.startswith(("tok_embeddings.", "wte.", "transformer.wte.")):
        return "embeddings"
    if name.startswith(("lm_head.", "output.")):
        return "lm_head"
    if "norm" in name:
        return "norms"
    return "other"


def _multimodal_component(name: str) -> str | None:
    """vision / projector / linear_attention for the tensors of multimodal and hybrid models
    (Kimi K2.5 vision_tower + mm_projector, Llama 4 vision_model + vision_adapter +
    multi_modal_projector, Qwen3-Next linear_attn); None for anything else."""
    if name.startswith(("mm_projector.", "multi_modal_projector.")) or ".vision_adapter." in name:
        return "projector"
    if name.startswith(("vision_tower.", "vision_model.")):
        return "vision"
    if ".linear_attn." in name:
        return "linear_attention"
    return None


class ExpectedTensor(NamedTuple):
    """A tensor a ModelSpec implies: shape, dtype (None: any), and whether it may be absent."""

    shape: tuple[int, ...]
    dtype: str | None = None
    optional: bool = False


_DEEPSEEK = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
_FROM_SPEC = ("kimi_k25", "llama4", "qwen3_next")  # expected names taken from ModelSpec.tensors()
_FAMILIES = (*_DEEPSEEK, "glm4_moe", "gpt_oss", "qwen3_moe", "mixtral", *_FROM_SPEC)


class _ExpectedBuilder:
    """Accumulates the tensors a ModelSpec implies, applying its quantization per component."""

    def __init__(self, spec):
        self.spec = spec
        self.out: dict[str, ExpectedTensor] = {}
        self.not_converted = tuple(spec.quant.modules_to_not_convert)

    def tensor(self, name: str, shape: Iterable[int], dtype: str | None = None, optional: bool = False):
        self.out[name] = ExpectedTensor(tuple(shape), dtype, optional)

    def _unconverted(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*")
                   for p in self.not_converted)

    def linear(self, module: str, out_features: int, in_features: int, component: str,
               bias: bool = False, quantizable: bool = True) -> None:
        """A [out_features, in_features] projection, stored as its component's QuantFormat says."""
        fmt = self.spec.quant.format_of(component)
        method = fmt.method if quantizable and not self._unconverted(module) else "unquantized"
        if method == "fp8_block":
            rows, cols = fmt.block_size or (128, 128)
            self.tensor(f"{module}.weight", (out_features, in_features), "F8_E4M3")
            self.tensor(f"{module}.weight_scale_inv", (-(-out_features // rows), -(-in_features // cols)))
        elif method == "int4":
            group = (fmt.block_size or (1, 32))[1]
            # compressed-tensors pack-quantized: eight int4 values per int32
            self.tensor(f"{module}.weight_packed", (out_features, in_features // 8), "I32")
            self.tensor(f"{module}.weight_scale", (out_features, -(-in_features // group)))
            self.tensor(f"{module}.weight_shape", (2,), "I64")
        elif method == "nvfp4":
            # ModelOpt NVFP4: two E2M1 values per byte, an e4m3 scale per 16, fp32 global and input scales
            self.tensor(f"{module}.weight", (out_features, in_features // 2), "U8")
            self.tensor(f"{module}.weight_scale", (out_features, -(-in_features // 16)), "F8_E4M3")
            self.tensor(f"{module}.weight_scale_2", (), "F32")
            self.tensor(f"{module}.input_scale", (), "F32")
        else:
            self.tensor(f"{module}.weight", (out_features, in_features))
        if bias:
            self.tensor(f"{module}.bias", (out_features,))

    def attention(self, prefix: str, att, hidden: int, o_bias: bool) -> None:
        p = f"{prefix}self_attn."
        heads = att.num_heads
        if att.kind in ("mla", "mla+dsa"):
            if att.q_lora_rank:
                self.linear(p + "q_a_proj", att.q_lora_rank, hidden, "attention")
                self.tensor(p + "q_a_layernorm.weight", (att.q_lora_rank,))
                self.linear(p + "q_b_proj", heads * att.head_dim, att.q_lora_rank, "attention")
            else:
                self.linear(p + "q_proj", heads * att.head_dim, hidden, "attention")
            self.linear(p + "kv_a_proj_with_mqa", att.kv_lora_rank + att.qk_rope_head_dim, hidden,
                        "attention")
            self.tensor(p + "kv_a_layernorm.weight", (att.kv_lora_rank,))
            self.linear(p + "kv_b_proj", heads * (att.qk_nope_head_dim + att.v_head_dim), att.kv_lora_rank,
                        "attention")
            self.linear(p + "o_proj", hidden, heads * att.v_head_dim, "attention")
            if att.kind == "mla+dsa":
                q_in = att.q_lora_rank or hidden
                self.linear(p + "indexer.wq_b", att.index_n_heads * att.index_head_dim, q_in, "indexer")
                self.linear(p + "indexer.wk", att.index_head_dim, hidden, "indexer")
                self.tensor(p + "indexer.k_norm.weight", (att.index_head_dim,))
                self.tensor(p + "indexer.k_norm.bias", (att.index_head_dim,))
                self.linear(p + "indexer.weights_proj", att.index_n_heads, hidden, "indexer",
                            quantizable=False)
            return
        kv = att.num_kv_heads
        self.linear(p + "q_proj", heads * att.head_dim, hidden, "attention", bias=att.bias)
        self.linear(p + "k_proj", kv * att.head_dim, hidden, "attention", bias=att.bias)
        self.linear(p + "v_proj", kv * att.v_head_dim, hidden, "attention", bias=att.bias)
        self.linear(p + "o_proj", hidden, heads * att.v_head_dim, "attention", bias=o_bias)
        if att.qk_norm:
            self.tensor(p + "q_norm.weight", (att.head_dim,))
            self.tensor(p + "k_norm.weight", (att.head_dim,))
        if att.sinks:
            self.tensor(p + "sinks", (heads,))

    def mlp(self, module: str, width: int, hidden: int, component: str, names=("gate_proj", "up_proj",
                                                                               "down_proj")) -> None:
        gate, up, down = names
        self.linear(f"{module}.{gate}", width, hidden, component)
        self.linear(f"{module}.{up}", width, hidden, component)
        self.linear(f"{module}.{down}", hidden, width, component)

    def moe(self, prefix: str, ffn, hidden: int, family: str) -> None:
        experts, width = ffn.num_experts, ffn.expert_intermediate
        if family == "mixtral":
            m = f"{prefix}block_sparse_moe"
            self.linear(f"{m}.gate", experts, hidden, "router", quantizable=False)
            for e in range(experts):
                self.mlp(f"{m}.experts.{e}", width, hidden, "routed_experts", names=("w1", "w3", "w2"))
            return
        m = f"{prefix}mlp"
        if family == "gpt_oss":
            self.linear(f"{m}.router", experts, hidden, "router", bias=ffn.bias, quantizable=False)
            self._fused_experts(f"{m}.experts", ffn, hidden)
            return
        self.linear(f"{m}.gate", experts, hidden, "router", quantizable=False)
        if ffn.correction_bias:
            self.tensor(f"{m}.gate.e_score_correction_bias", (experts,))
        for e in range(experts):
            self.mlp(f"{m}.experts.{e}", width, hidden, "routed_experts")
        if ffn.num_shared_experts:
            self.mlp(f"{m}.shared_experts", ffn.shared_intermediate, hidden, "shared_experts")

    def _fused_experts(self, m: str, ffn, hidden: int) -> None:
        """gpt-oss experts: gate/up fused along the output dim; MXFP4 packs 32 elements into
        16 bytes per block with one uint8 (E8M0) scale per block."""
        experts, width = ffn.num_experts, ffn.expert_intermediate
        if self.spec.quant.format_of("routed_experts").method == "mxfp4":
            self.tensor(f"{m}.gate_up_proj_blocks", (experts, 2 * width, hidden // 32, 16), "U8")
            self.tensor(f"{m}.gate_up_proj_scales", (experts, 2 * width, hidden // 32), "U8")
            self.tensor(f"{m}.down_proj_blocks", (experts, hidden, width // 32, 16), "U8")
            self.tensor(f"{m}.down_proj_scales", (experts, hidden, width // 32), "U8")
        else:
            self.tensor(f"{m}.gate_up_proj", (experts, hidden, 2 * width))
            self.tensor(f"{m}.down_proj", (experts, width, hidden))
        if ffn.bias:
            self.tensor(f"{m}.gate_up_proj_bias", (experts, 2 * width))
            self.tensor(f"{m}.down_proj_bias", (experts, hidden))

    def layer(self, layer, family: str, mtp: bool) -> None:
        spec = self.spec
        hidden = spec.hidden
        prefix = f"model.layers.{layer.index}."
        self.tensor(prefix + "input_layernorm.weight", (hidden,))
        self.tensor(prefix + "post_attention_layernorm.weight", (hidden,))
        self.attention(prefix, layer.attention, hidden, o_bias=family == "gpt_oss" and layer.attention.bias)
        if layer.ffn.kind == "moe":
            self.moe(prefix, layer.ffn, hidden, family)
        else:
            self.mlp(prefix + "mlp", layer.ffn.intermediate, hidden, "dense_mlp")
        if mtp:
            # DeepSeek-style next-token module: two norms, a [hidden, 2*hidden] projection and its
            # own head; GLM-4.6 checkpoints ship without the head and embedding copy.
            optional_head = family == "glm4_moe"
            self.tensor(prefix + "enorm.weight", (hidden,))
            self.tensor(prefix + "hnorm.weight", (hidden,))
            self.tensor(prefix + "eh_proj.weight", (hidden, 2 * hidden))
            self.tensor(prefix + "shared_head.norm.weight", (hidden,))
            self.tensor(prefix + "shared_head.head.weight", (spec.vocab, hidden), optional=optional_head)
            self.tensor(prefix + "embed_tokens.weight", (spec.vocab, hidden), optional=optional_head)


def expected_tensors(spec) -> dict[str, ExpectedTensor] | None:
    """Tensor name -> ExpectedTensor for every tensor a ModelSpec implies in a Hugging Face
    checkpoint (main layers, MTP layers, embeddings, final norm, head); None for a model_type
    whose naming is not known here."""
    family = spec.model_type
    if family not in _FAMILIES:
        return None
    if family in _FROM_SPEC:
        return _expected_from_spec(spec)
    builder = _ExpectedBuilder(spec)
    builder.tensor("model.embed_tokens.weight", (spec.vocab, spec.hidden))
    for layer in spec.layers:
        builder.layer(layer, family, mtp=layer.is_mtp)
    for layer in spec.mtp_layers:
        builder.layer(layer, family, mtp=True)
    builder.tensor("model.norm.weight", (spec.hidden,))
    if not spec.tie_embeddings:
        builder.tensor("lm_head.weight", (spec.vocab, spec.hidden))
    return builder.out


def _expected_from_spec(spec) -> dict[str, ExpectedTensor]:
    """Expected tensors of the multimodal and hybrid families, from ModelSpec.tensors(): every
    quantizable ``*.weight`` matrix stored as its component's format (per expert for the
    ``experts.*`` stacks), everything else as named with its logical shape."""
    builder = _ExpectedBuilder(spec)
    for t in spec.tensors():
        if not (t.quantizable and len(t.shape) >= 2 and t.name.endswith(".weight")):
            builder.tensor(t.name, t.shape)
            continue
        module = t.name.removesuffix(".weight")
        if "*" in module:
            for e in range(t.shape[0]):
                builder.linear(module.replace("*", str(e)), t.shape[-2], t.shape[-1], t.component)
        else:
            builder.linear(module, t.shape[-2], t.shape[-1], t.component)
    return builder.out
