"""Checkpoints above the whole-content limit still enter stage 5/6 fingerprints by content (sampled), never by mtime."""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from adapt import report
from adapt.report import RunDir, checkpoint_data_digest, load_gates
from adapt.stages.pipeline import validate
from tests.test_provenance import BASE, _model_dir, fake_stages  # noqa: F401 (fixture)

DATA_BYTES = 65 * 2**20  # over the 64 MiB a file is hashed whole above the checkpoint limit (on main too)
OLD_NS = 1_600_000_000 * 10**9


@pytest.fixture
def large(monkeypatch):
    """Every checkpoint counts as large: the sampled digest, not sha256 of every byte."""
    monkeypatch.setattr(report, "CONTENT_DIGEST_MAX_BYTES", 0)


def _large_model(tmp_path, fill: bytes = b"\x11") -> str:
    """A model directory whose one shard holds a 65 MiB BF16 tensor; its mtime is set to a fixed old time."""
    model = _model_dir(tmp_path)
    header = json.dumps({"lm_head.weight": {"dtype": "BF16", "shape": [DATA_BYTES // 2],
                                            "data_offsets": [0, DATA_BYTES]}}).encode()
    shard = Path(model) / "model.safetensors"
    shard.write_bytes(struct.pack("<Q", len(header)) + header + fill * DATA_BYTES)
    os.utime(shard, ns=(OLD_NS, OLD_NS))
    return model


def _rewrite_same_size_same_mtime(shard: Path, fill: bytes) -> None:
    """A re-quantized shard copied in with `cp -p` / `rsync -t`: same header, size and mtime, other tensor bytes."""
    stat = shard.stat()
    data = shard.read_bytes()
    start = 8 + struct.unpack("<Q", data[:8])[0]
    shard.write_bytes(data[:start] + fill * (len(data) - start))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert shard.stat().st_size == stat.st_size and shard.stat().st_mtime_ns == stat.st_mtime_ns


def test_a_same_size_same_mtime_rewrite_of_a_large_checkpoint_runs_stage_5_again(tmp_path, fake_stages, large):  # noqa: F811
    options = replace(BASE, model=_large_model(tmp_path))
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    fake_stages.clear()
    _rewrite_same_size_same_mtime(Path(options.model) / "model.safetensors", b"\x22")
    validate(6, options, run, load_gates())
    assert "precision" in fake_stages
    assert not {"inventory", "memory", "kernels", "parallel"} & set(fake_stages)


def test_a_copy_of_a_large_checkpoint_elsewhere_with_new_mtimes_reuses_stage_5(tmp_path, fake_stages, large):  # noqa: F811
    options = replace(BASE, model=_large_model(tmp_path))
    run = RunDir(tmp_path, "r")
    validate(6, options, run, load_gates())
    fake_stages.clear()
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(options.model, copy, copy_function=shutil.copy)  # plain cp: new mtimes
    assert (copy / "model.safetensors").stat().st_mtime_ns != OLD_NS
    assert checkpoint_data_digest(str(copy)).startswith("sampled:")
    validate(6, replace(options, model=str(copy)), run, load_gates())
    assert fake_stages == ["bench"]  # the stage asked for always runs; stage 5 is reused


@pytest.mark.parametrize("where", ["first", "middle-block", "last"])
def test_the_sampled_digest_sees_a_change_in_the_first_last_and_a_sampled_block(tmp_path, large, where):
    """Block 0 starts at the first tensor byte, the last block ends at the file's end, the others spread between."""
    shard = Path(_large_model(tmp_path)) / "model.safetensors"
    before = checkpoint_data_digest(str(shard.parent))
    data = bytearray(shard.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    span = len(data) - start - report.SAMPLE_BLOCK_BYTES
    at = {"first": start, "last": len(data) - 1,
          "middle-block": start + span * 16 // (report.SAMPLE_BLOCKS - 1) + 5}[where]
    data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(OLD_NS, OLD_NS))
    assert checkpoint_data_digest(str(shard.parent)) != before


def test_a_large_shard_costs_its_header_and_the_sampled_blocks_to_digest(tmp_path, monkeypatch):
    """Default limits, a 3 GiB (sparse) shard: the digest reads 8 + header + 32 x 64 KiB of it, whatever its size."""
    model = Path(_model_dir(tmp_path))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3 * 2**29], "data_offsets": [0, 3 * 2**30]}}).encode()
    shard = model / "model.safetensors"
    with open(shard, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + 3 * 2**30)
    read: dict[str, int] = {}

    class Counting:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def seek(self, offset):
            return self.handle.seek(offset)

        def read(self, size=-1):
            data = self.handle.read(size)
            read[Path(self.handle.name).name] = read.get(Path(self.handle.name).name, 0) + len(data)
            return data

    monkeypatch.setattr(report, "open", lambda path, mode: Counting(open(path, mode)), raising=False)
    assert checkpoint_data_digest(str(model)).startswith("sampled:")
    assert read["model.safetensors"] == 8 + len(header) + report.SAMPLE_BLOCKS * report.SAMPLE_BLOCK_BYTES
    assert read["config.json"] == (model / "config.json").stat().st_size  # small files: every byte
