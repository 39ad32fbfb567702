"""`adapt bench runtime` on CPU at reduced width: the same code path as the GPU run, with rows that
the acceptance lines read (no GPU: no ceilings, so no roofline and every line unmet)."""

import json

from typer.testing import CliRunner

from adapt.bench.runtime import LayerBytes, write_checkpoint
from adapt.cli import app


def test_layer_bytes_roofline_terms():
    info = LayerBytes(dense_bytes=100, dense_params=50, expert_bytes=10, expert_params=20, moe_layers=2,
                      experts=8, top_k=2, head_bytes=30, head_params=15, hidden=4)
    assert info.decode_bytes(1) == 100 + 30 + 2 * 2 * 10 + 8
    assert info.prefill_bytes() == 100 + 30 + 2 * 8 * 10
    assert info.flops(3) == 2 * 3 * (50 + 15 + 2 * 2 * 20)


def test_tiny_checkpoint_counts_what_it_writes(tmp_path):
    info = write_checkpoint("gpt-oss-120b", tmp_path, device="cpu", tiny=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["hidden_size"] == 256 and info.experts == 8 and info.moe_layers == 2 and info.top_k == 2
    # gate, up and down of one expert (MXFP4 codes, two per byte) and their biases
    assert info.expert_params == 3 * 256 * 256 + 3 * 256
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks" in index


def test_bench_runtime_dry_run_on_cpu(tmp_path):
    result = CliRunner().invoke(app, ["bench", "runtime", "--device", "cpu", "--tiny", "--kernels", "none",
                                      "-m", "deepseek-v3.2", "-b", "2", "--prompt-tokens", "8",
                                      "--decode-steps", "1", "--output", str(tmp_path), "--json"])
    report = json.loads((tmp_path / "runtime_bench.json").read_text())
    rows = report["tables"]["rows"]
    assert [(r["phase"], r["batch"]) for r in rows] == [("prefill", 2), ("decode", 2)]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert result.exit_code == 1   # no ceilings on a CPU, so no fraction of roofline: unmet, not passed
    assert all(line["value"] is None and not line["met"] for line in report["tables"]["acceptance"])


def test_rows_are_on_disk_after_each_batch_so_a_killed_run_keeps_them(tmp_path):
    """The report is rewritten after every batch: a run stopped from outside (here: the progress
    callback raises after the first batch, as a kill would land) leaves that batch's rows, and its
    other lines unmet."""
    import pytest

    from adapt.bench.runtime import run_runtime_bench

    messages = []

    def progress(message):
        messages.append(message)
        if "batch 1:" in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_runtime_bench(["gpt-oss-120b"], batches=[1, 2], prompt_tokens=8, decode_steps=1, kernels="none",
                          device="cpu", tiny=True, out_dir=tmp_path, progress=progress)
    report = json.loads((tmp_path / "runtime_bench.json").read_text())
    assert [(r["batch"], r["phase"]) for r in report["tables"]["rows"]] == [(1, "prefill"), (1, "decode")]
    assert all(r["load_s"] >= 0 and r["warmup_s"] >= 0 for r in report["tables"]["rows"])
    assert len(report["tables"]["acceptance"]) == 4   # batch 2's lines are there, unmet (no CPU roofline either)
    assert not any(line["met"] for line in report["tables"]["acceptance"])
    assert report["verdict"] == "fail"
    assert any("checkpoint written" in m for m in messages)
