"""One headroom rule: stages 2 and 4 and preflight give the same verdict on the same inputs."""

import pytest

from adapt.plan.headroom import DOES_NOT_FIT, FEWER, FITS, assess, margin_bytes
from adapt.report import RunDir, load_gates
from adapt.stages.memory import run_plan_memory
from adapt.stages.parallel import run_plan_parallel
from adapt.stages.preflight import run_preflight

GiB = 2**30


@pytest.mark.parametrize("weights, sequences, verdict", [
    (100, 2, FITS), (100, 3, FEWER), (125, 1, DOES_NOT_FIT), (130, 1, DOES_NOT_FIT),
])
def test_rule(weights, sequences, verdict):
    rule = assess({"weights": weights * GiB, "headroom": margin_bytes(20 * GiB, 0.2)}, budget_bytes=126 * GiB,
                  kv_bytes_per_sequence=10 * GiB, requested_sequences=sequences)
    assert rule.verdict == verdict and rule.passes == (verdict == FITS)
    assert rule.free_bytes == pytest.approx((126 - weights - 4 - 10 * sequences) * GiB)


@pytest.mark.parametrize("batch, verdict", [(8, "fail"), (2, "pass")])
def test_qwen3_30b_on_one_h100_at_32k_same_verdict_in_stages_2_4_and_preflight(tmp_path, batch, verdict):
    """The issue's case: Qwen3-30B-A3B, 1 x H100, 32K context, batch 8 (stage 2 said WARN, stage 4 FAIL)."""
    gates = load_gates()
    args = dict(devices=1, context=32768, batch=batch)
    memory = run_plan_memory("qwen3-30b-a3b", "h100-sxm", gates=gates, **args)
    parallel = run_plan_parallel("qwen3-30b-a3b", "h100-sxm", gates=gates, **args)
    run = RunDir(tmp_path, "r")
    run.write(memory)
    preflight = run_preflight("h100-sxm", None, run.path, gates=gates, gpus=None)
    check = next(row for row in preflight.tables["checklist"] if row["check"] == "memory headroom")
    assert memory.verdict == verdict
    assert parallel.verdict == verdict
    assert check["status"] == ("ok" if verdict == "pass" else "fail")
