"""Hand-off: vLLM quantization settings for the plan's weight format (or a refusal with the reason),
the format recorded in the bundle; rope overrides that keep every field of the model's rope_scaling,
checked through vLLM's own config code."""

from __future__ import annotations

import json
import subprocess

import pytest

from adapt.errors import InputError
from adapt.handoff.vllm import vllm_quantization
from adapt.model.spec import load_spec
from adapt.plan.launch import rope_override, serve_command
from adapt.report import RunDir, StageReport, load_gates
from adapt.stages.pipeline import PipelineOptions, stage_fingerprint, stamp
from tests.cli_run import REPO, snapshot
from tests.cli_run import adapt as run_adapt

SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"


@pytest.mark.parametrize("stored, experts, weights, args", [
    ("none", "bf16", "as-stored", {}),
    ("fp8", "fp8", "as-stored", {}),
    ("none", "bf16", "fp8", {"quantization": "fp8_per_block"}),
    ("fp8", "fp8", "fp8", {}),
    ("none", "bf16", "mxfp4-online", {"quantization": "online", "quantization_config": {"moe": "mxfp4"}}),
    ("mxfp4", "mxfp4", "mxfp4-online", {}),
    ("none", "bf16", "mxfp4-offline-fp8", {"quantization": "online", "quantization_config": {"moe": "fp8_per_block"}}),
    ("fp8", "fp8", "mxfp4-offline-fp8", {}),
    ("none", "bf16", "bf16", {}),
])
def test_quantization_settings_vllm_needs(stored, experts, weights, args):
    got, how = vllm_quantization(stored, experts, weights)
    assert got == args and how


@pytest.mark.parametrize("stored, experts, weights, reason", [
    ("fp8", "fp8", "mxfp4-online", "cannot convert quantized experts at load"),
    ("mxfp4", "mxfp4", "mxfp4-offline-fp8", "cannot convert quantized experts at load"),
    ("fp8", "fp8", "bf16", "vLLM loads it in that format"),
    ("mxfp4", "mxfp4", "fp8", "does not re-quantize"),
])
def test_quantization_refusals_say_why(stored, experts, weights, reason):
    with pytest.raises(InputError, match=reason) as err:
        vllm_quantization(stored, experts, weights)
    assert err.value.field == "--weights"


def _run(tmp_path, model: str, weights: str) -> RunDir:
    options = PipelineOptions(model=model, target="h100-sxm", devices=8, nodes=1, context=8192, batch=1,
                              weights=weights)
    run = RunDir(tmp_path, "q")
    for number, name in ((1, "inventory"), (2, "memory"), (3, "kernels"), (4, "parallel")):
        report = StageReport(name, number, name)
        if name == "parallel":
            report.metrics["engine_args"] = {"tensor_parallel_size": 8, "max_model_len": 8192}
        stamp(report, stage_fingerprint(number, options, load_gates()))
        run.write(report)
    return run


def test_mxfp4_online_plan_of_an_fp8_checkpoint_is_refused(tmp_path, capsys):
    """The issue's case: DeepSeek (fp8 experts) planned with --weights mxfp4-online on 8 x H100."""
    run = _run(tmp_path, "deepseek-v3.2", "mxfp4-online")
    before = snapshot(run.path)
    result = run_adapt(capsys, "handoff", "deepseek-v3.2", "--target", "h100-sxm", "--devices", "8",
                       "--run", "q", "--output", tmp_path)
    assert result.code == 2
    (line,) = result.lines
    assert "hand-off refused" in line and "--weights" in line and "experts are fp8" in line
    assert snapshot(run.path) == before


def test_bundle_records_the_format_and_serves_with_vllms_online_quantization(tmp_path, capsys):
    run = _run(tmp_path, "qwen3-30b-a3b", "mxfp4-online")
    result = run_adapt(capsys, "handoff", "qwen3-30b-a3b", "--target", "h100-sxm", "--devices", "8",
                       "--run", "q", "--output", tmp_path)
    assert result.code == 0, result.stderr
    bundle = json.loads((run.path / "handoff" / "engine_args.json").read_text())
    assert bundle["weights_format"]["plan"] == "mxfp4-online"
    assert bundle["engine_args"]["quantization"] == "online"
    assert bundle["engine_args"]["quantization_config"] == {"moe": "mxfp4"}
    serve = (run.path / "handoff" / "serve.sh").read_text()
    assert "--quantization online --quantization-config '{\"moe\":\"mxfp4\"}'" in serve
    assert "mxfp4-online" in (run.path / "handoff" / "README.md").read_text()


@pytest.mark.parametrize("model", ["deepseek-v3.2", "gpt-oss-120b", "qwen3-30b-a3b"])
def test_rope_override_keeps_every_field_and_changes_only_the_factor(model):
    spec = load_spec(model)
    own = spec.config.get("rope_scaling")
    base = spec.rope.original_max_position or spec.max_position
    override = rope_override(own, theta=spec.rope.theta, base=base, factor=80.0)
    scaling = override["rope_scaling"]
    for key, value in (own or {}).items():
        assert scaling[key] == (80.0 if key == "factor" else value), key
    assert scaling["factor"] == 80.0 and scaling["rope_theta"] == spec.rope.theta
    assert override["max_position_embeddings"] == base * 80


_VLLM_CHECK = r"""
import json, sys
from vllm.transformers_utils.config import get_config
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
model_dir, override, argv = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
own = get_config(model_dir, trust_remote_code=False)
new = get_config(model_dir, trust_remote_code=False, hf_overrides_kw=override)
args = AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:]))
print("ADAPT " + json.dumps({"own": own.rope_parameters, "new": new.rope_parameters,
                             "max_position": new.max_position_embeddings, "quantization": args.quantization,
                             "quantization_config": str(args.quantization_config),
                             "hf_overrides": args.hf_overrides}, default=str))
"""


@pytest.mark.vllm
def test_rope_override_and_quantization_through_vllms_own_config_code(tmp_path):
    """DeepSeek-V3.2 extended from factor 40 to 80: vLLM's config keeps mscale, mscale_all_dim, betas
    and rope_theta; vLLM's parser accepts the online quantization arguments."""
    if not SERVE_PYTHON.exists():
        pytest.skip("no .venv-serve beside the checkout (make serve-env)")
    model_dir = tmp_path / "ds"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((REPO / "adapt" / "model" / "presets" / "deepseek-v3.2.json").read_text())
    spec = load_spec(str(model_dir))
    override = rope_override(spec.config["rope_scaling"], theta=spec.rope.theta, base=4096, factor=80.0)
    argv = serve_command(str(model_dir), {"quantization": "online", "quantization_config": {"moe": "mxfp4"},
                                          "hf_overrides": override})
    done = subprocess.run([str(SERVE_PYTHON), "-c", _VLLM_CHECK, str(model_dir), json.dumps(override),
                           json.dumps(argv)], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "VLLM_TARGET_DEVICE": "cpu", "HOME": str(tmp_path)})
    marker = [line for line in done.stdout.splitlines() if line.startswith("ADAPT ")]
    assert marker, done.stderr[-3000:]
    result = json.loads(marker[-1][6:])
    assert result["own"]["factor"] == 40 and result["new"]["factor"] == 80
    assert {k: v for k, v in result["new"].items() if k != "factor"} == \
        {k: v for k, v in result["own"].items() if k != "factor"}
    assert result["max_position"] == 4096 * 80
    # moe experts as uint8 E2M1 pairs with one scale per 32 (MXFP4); linear layers left alone
    assert result["quantization"] == "online"
    assert "linear=None" in result["quantization_config"] and "col=32" in result["quantization_config"]
    assert result["hf_overrides"] == override
