"""Token comparison and the hand-off gate on hand-made traces."""

import math

from adapt.handoff.smoke import Trace, _token_id, compare, gate
from adapt.report import load_gates

GATES = load_gates()["handoff"]


def trace(tokens, top_sets, chosen=-0.1):
    """A Trace whose step i chose tokens[i] with logprob ``chosen`` and ranks top_sets[i] (best first)."""
    top = [{t: chosen - 0.5 * rank for rank, t in enumerate(ids)} for ids in top_sets]
    return Trace(tokens=list(tokens), logprobs=[top[i][tokens[i]] for i in range(len(tokens))], top=top)


def test_identical_traces_agree_everywhere():
    ref = trace([5, 6, 7], [[5, 1, 2, 3, 4], [6, 1, 2, 3, 4], [7, 1, 2, 3, 4]])
    c = compare("p", 3, ref, ref)
    assert c.first_divergence is None
    assert c.top5_overlap == [1.0, 1.0, 1.0]
    assert c.max_logprob_diff == 0.0
    assert gate([c], GATES) == []


def test_first_divergence_position_and_overlap_up_to_it():
    ref = trace([5, 6, 7, 8], [[5, 1, 2, 3, 4], [6, 9, 2, 3, 4], [7, 1, 2, 3, 4], [8, 1, 2, 3, 4]])
    cand = trace([5, 9, 1, 1], [[5, 1, 2, 3, 4], [9, 6, 2, 3, 10], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    c = compare("p", 3, ref, cand)
    assert c.first_divergence == 1
    assert c.top5_overlap == [1.0, 0.8]          # steps after the divergence have other contexts
    assert math.isclose(c.divergence_gap, 0.5)   # reference ranks 9 one step (0.5 nats) below 6
    assert not c.near_tie(GATES["tie_logprob_gap"])
    codes = [code for _, code, _ in gate([c], GATES)]
    assert "tokens-diverge" in codes


def test_near_tie_is_a_warning_not_a_failure():
    rest = {1: -3.0, 2: -3.1, 3: -3.2}
    ref = Trace([5, 6], [-0.7, -0.70], [{5: -0.7, 4: -0.9, **rest}, {6: -0.700, 9: -0.701, **rest}])
    cand = Trace([5, 9], [-0.7, -0.70], [{5: -0.7, 4: -0.9, **rest}, {9: -0.700, 6: -0.701, **rest}])
    c = compare("p", 2, ref, cand)
    assert c.first_divergence == 1 and c.near_tie(GATES["tie_logprob_gap"])
    findings = gate([c], GATES)
    assert [(s, code) for s, code, _ in findings] == [("warn", "near-tie")]


def test_candidate_token_outside_reference_top5_has_infinite_gap():
    ref = trace([5], [[5, 1, 2, 3, 4]])
    cand = trace([42], [[42, 5, 1, 2, 3]])
    assert compare("p", 1, ref, cand).divergence_gap == math.inf


def test_logprob_drift_and_low_overlap_fail_even_when_tokens_agree():
    ref = trace([5, 6], [[5, 1, 2, 3, 4], [6, 1, 2, 3, 4]])
    drift = Trace([5, 6], [-0.1, -0.4], [{5: -0.1, 10: -1, 11: -2, 12: -3, 13: -4}, {6: -0.4, 1: -1}])
    c = compare("p", 2, ref, drift)
    assert c.first_divergence is None
    assert math.isclose(c.max_logprob_diff, 0.3, rel_tol=1e-6)
    codes = {code for _, code, _ in gate([c], GATES)}
    assert codes == {"logprob-drift", "top5-overlap"}


def test_shorter_candidate_diverges_where_it_stops():
    ref = trace([5, 6], [[5, 1, 2, 3, 4], [6, 1, 2, 3, 4]])
    cand = trace([5], [[5, 1, 2, 3, 4]])
    assert compare("p", 1, ref, cand).first_divergence == 1


def test_token_id_spelling():
    assert _token_id("token_id:123") == 123
    try:
        _token_id("hello")
    except ValueError as exc:
        assert "token_id" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_cpu_launch_serves_mla_checkpoints_with_the_reference_cpu_mla_backend(tmp_path):
    import json

    from adapt.handoff.smoke import local_engine_args

    mla, gqa = tmp_path / "mla", tmp_path / "gqa"
    mla.mkdir()
    gqa.mkdir()
    (mla / "config.json").write_text(json.dumps({"text_config": {"kv_lora_rank": 512}}))
    (gqa / "config.json").write_text(json.dumps({"num_key_value_heads": 4}))
    common = dict(dtype="float32", max_model_len=512, memory_fraction=0.1)
    args, changed = local_engine_args({}, cuda=False, model_dir=mla, **common)
    assert args["attention_backend"] == changed["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in local_engine_args({}, cuda=False, model_dir=gqa, **common)[0]
    assert "attention_backend" not in local_engine_args({}, cuda=True, model_dir=mla, **common)[0]
    asked = local_engine_args({"attention_backend": "AMX_MLA"}, cuda=False, model_dir=mla, **common)
    assert asked[0]["attention_backend"] == "AMX_MLA" and "attention_backend" not in asked[1]
