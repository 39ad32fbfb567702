"""The MoE and DSA kernel benchmarks report through adapt.bench: acceptance lines from measured rows
(a missing row is unmet), every timed row checked against its twin (over the tolerance fails; a
baseline only warns). Fake rows for the lines; the real row-making code on CPU under the interpreter
for the twin errors."""

import pytest
import torch

from adapt.stages import bench_dsa, bench_moe

PROV = dict(date="2026-11-30", commit="abc", gpu="test", torch="t", triton="t", ceilings={})


def moe_row(tokens, variant, time_us, twin=1e-3, **fields):
    return dict(dict(shape="deepseek-v3", tokens=tokens, variant=variant, time_us=time_us, twin_rel_error=twin,
                     twin_tolerance=5e-3, baseline=variant in bench_moe.BASELINES, copy_fraction=0.5, x_floor=2.0,
                     tflops=100.0), **fields)


def passing_moe_rows():
    return [moe_row(64, "planar", 10.0, copy_fraction=0.9), moe_row(64, "bf16", 20.0),
            moe_row(1, "planar", 5.0, x_floor=1.5),
            moe_row(16384, "fp8_offline", 100.0, tflops=900.0), moe_row(16384, "torch_grouped_bf16", 160.0),
            moe_row(16384, "fp8_ws", 104.0)]


def test_moe_report_lines_come_from_rows_and_a_missing_row_is_unmet():
    result = dict(PROV, rows=passing_moe_rows())
    report = bench_moe.moe_report(result)
    assert report.verdict == "pass" and all(line["met"] for line in report.tables["acceptance"])
    lines = {a["criterion"]: a for a in bench_moe.acceptance(result)}
    assert lines["T=64 fused MXFP4 >= 0.85 of copy on MXFP4 bytes"]["path"] == "planar"
    result["rows"] = [r for r in result["rows"] if r["variant"] != "fp8_ws"]
    report = bench_moe.moe_report(result)
    online = next(a for a in report.tables["acceptance"] if "online" in a["criterion"])
    assert online["value"] is None and not online["met"] and report.verdict == "fail"
    assert any("missing" in f.message for f in report.findings if f.severity == "error")


def test_moe_report_fails_a_row_over_its_twin_tolerance_and_warns_for_a_baseline():
    rows = passing_moe_rows()
    rows[-2]["twin_rel_error"] = 0.4   # the torch baseline (no biases) computes something else: a warning
    report = bench_moe.moe_report(dict(PROV, rows=rows))
    assert report.verdict == "warn"
    assert [f.code for f in report.findings if f.severity == "warn"] == ["bench.twin"]
    rows[0]["twin_rel_error"] = 0.02   # adapt's kernel 4x over the tolerance: an error, whatever its speed
    report = bench_moe.moe_report(dict(PROV, rows=rows))
    assert report.verdict == "fail"
    assert [f.code for f in report.findings if f.severity == "error"] == ["bench.twin"]
    del rows[0]["twin_rel_error"]
    assert "bench.untwinned" in {f.code for f in bench_moe.moe_report(dict(PROV, rows=rows)).findings}


def dsa_result(**prefill):
    decode = [dict(batch=b, context=131072, step_us=us, step_us_per_layer_in_graph_of_layers=us, step_over_floor=ratio,
                   sparse_mla_TFLOPs=tf,
                   topk_equals_twin=True, index_scores_rel_err_vs_twin=1e-4, sparse_mla_rel_err_vs_twin=2e-3)
              for b, us, ratio, tf in ((1, 30.0, 6.0, 50.0), (64, 400.0, 1.4, 320.0))]
    pre = dict(tokens=131072, total_ms=400.0, index_scores_all_TFLOPs=950.0, speedup_vs_dense=3.2,
               topk_last4096_rows_ms={"triton_equals_twin_rows0_8": True}, index_scores_rel_err_vs_twin=1e-4,
               sparse_mla_rel_err_vs_twin=2e-3) | prefill
    return dict(PROV, decode=decode, prefill=[pre], errors=[])


def test_dsa_report_lines_twins_and_missing_rows():
    assert bench_dsa.dsa_report(dsa_result()).verdict == "pass"
    assert all(line["met"] for line in bench_dsa.acceptance_lines(dsa_result()))
    report = bench_dsa.dsa_report(dsa_result(topk_last4096_rows_ms={"triton_equals_twin_rows0_8": False}))
    assert report.verdict == "fail" and "differs from the twin" in report.findings[-1].message
    report = bench_dsa.dsa_report(dsa_result(sparse_mla_rel_err_vs_twin=0.03))
    assert [f.code for f in report.findings if f.severity == "error"] == ["bench.twin"]
    result = dsa_result()
    result["prefill"], result["errors"] = [], ["prefill: OutOfMemoryError: ..."]
    lines = bench_dsa.acceptance_lines(result)
    assert [line["met"] for line in lines] == [True, True, True, True, False, False]
    assert lines[4]["measured"] is None
    assert bench_dsa.dsa_report(result).verdict == "fail"


def test_moe_bench_rows_carry_twin_errors_on_cpu(monkeypatch):
    """_bench_shape at a tiny gpt-oss shape under the interpreter (timer stubbed): every adapt row has
    its error against the twin; a kernel made 1% wrong exceeds the tolerance and fails the report."""
    from adapt.bench.timer import Timing
    from adapt.kernels import moe_gemm

    monkeypatch.setattr(bench_moe, "DEVICE", "cpu")
    monkeypatch.setattr(bench_moe, "time_cuda", lambda fn, reps=20, **kw: (fn(), Timing(10.0, 1, "eager"))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    shape = dict(bench_moe.SHAPES["gpt-oss-120b"], experts=4, top_k=2, hidden=64, intermediate=64)

    def run():
        rows = []
        bench_moe._bench_shape("gpt-oss-120b", shape, [3], {"copy_tbps": 1.0}, rows, 1e18, lambda: None, None,
                               layer=False, memory=False, only={"fp8_offline", "torch_grouped_bf16"})
        return {r["variant"]: r for r in rows}

    rows = run()
    for variant in ("bf16", "fp8_offline"):
        assert rows[variant]["twin_rel_error"] < 1e-6 and not rows[variant]["baseline"]
    assert rows["torch_grouped_bf16"]["baseline"] and rows["torch_grouped_bf16"]["twin_rel_error"] > 0
    kernel = moe_gemm.expert_mlp
    monkeypatch.setattr(moe_gemm, "expert_mlp", lambda *a, **k: kernel(*a, **k) * (
        1.01 if k.get("fp8_weights") is not None else 1.0))
    rows = run()
    assert rows["fp8_offline"]["twin_rel_error"] == pytest.approx(0.01, rel=0.05)
    report = bench_moe.moe_report(dict(PROV, rows=list(rows.values())))
    assert any(f.code == "bench.twin" and "fp8_offline" in f.message for f in report.findings
               if f.severity == "error")


def _small_prefill():
    from adapt.kernels.formats import FP8_DTYPE, PAGE_SIZE
    from adapt.runtime.kv_cache import PagedKVCache, mla_layout

    torch.manual_seed(0)
    length, heads, topk, rows = 128, 8, 32, 4
    cache = PagedKVCache(length // PAGE_SIZE, {0: mla_layout(bench_dsa.RANK, bench_dsa.ROPE, bench_dsa.INDEX_DIM,
                                                             latent_format="fp8")}, "cpu")
    layer = cache.dsa_layer(0)
    layer.index_k[:] = torch.randn(*layer.index_k.shape).mul_(30).to(FP8_DTYPE)
    layer.index_scale[:] = torch.rand(*layer.index_scale.shape) * 0.01
    layer.latent_nope[:] = torch.randn(*layer.latent_nope.shape).to(layer.latent_nope.dtype)
    layer.latent_scale[:] = torch.rand(*layer.latent_scale.shape) * 0.01
    layer.latent_rope[:] = torch.randn(*layer.latent_rope.shape).to(layer.latent_rope.dtype)
    return dict(q8=torch.randn(length, bench_dsa.INDEX_HEADS, bench_dsa.INDEX_DIM).to(FP8_DTYPE),
                weights=torch.rand(length, bench_dsa.INDEX_HEADS),
                q_nope=torch.randn(rows, heads, bench_dsa.RANK, dtype=torch.bfloat16),
                q_rope=torch.randn(rows, heads, bench_dsa.ROPE, dtype=torch.bfloat16), layer=layer,
                block_table=torch.arange(length // PAGE_SIZE, dtype=torch.int32)[None],
                token_seq=torch.zeros(length, dtype=torch.int32), limits=torch.arange(1, length + 1, dtype=torch.int32),
                idx=torch.stack([torch.randperm(length)[:topk] for _ in range(length)]).int(), length=length,
                tiles={"prefill_index": {}}, mla_options={})


def test_dsa_prefill_twin_checks_on_cpu(monkeypatch):
    from adapt.kernels import sparse_mla

    args = _small_prefill()
    got = bench_dsa._prefill_twin_checks(**args)
    assert got["index_scores_rel_err_vs_twin"] < 1e-6 and got["sparse_mla_rel_err_vs_twin"] < 1e-3
    kernel = sparse_mla.sparse_mla
    monkeypatch.setattr(sparse_mla, "sparse_mla", lambda *a, **k: kernel(*a, **k) * 1.02)
    assert bench_dsa._prefill_twin_checks(**args)["sparse_mla_rel_err_vs_twin"] > 0.01

    def refuse(*a, **k):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(bench_dsa.dsa, "index_scores", refuse)   # a check that cannot run is recorded, not raised
    assert bench_dsa._prefill_twin_checks(**args) == {"twin_check_error": "RuntimeError: out of resources"}


def test_peer_swiglu_follows_both_triton_kernels_apis():
    """The peer's fused SwiGLU is built for either triton_kernels API: ``reduction_n`` on ``FusedActivation`` (tag
    v3.6.0, as vLLM vendors it) or on ``FnSpecs`` (triton's main after it); both give two inputs an output."""
    from dataclasses import dataclass

    from adapt.stages.bench_moe import _peer_swiglu

    @dataclass(frozen=True)
    class SpecsOld:
        name: str
        fn: object
        fn_arg_names: tuple

    @dataclass(frozen=True)
    class ActOld:
        specs: SpecsOld
        fn_args: tuple = ()
        reduction_n: int = 1

    @dataclass(frozen=True)
    class SpecsNew:
        name: str
        fn: object
        fn_arg_names: tuple
        reduction_n: int = 1

    @dataclass(frozen=True)
    class ActNew:
        specs: SpecsNew
        fn_args: tuple = ()

    old = _peer_swiglu(SpecsOld, ActOld, "fn")
    assert (old.reduction_n, old.fn_args, old.specs.fn_arg_names) == (2, (1.702, 7.0), ("alpha", "limit"))
    new = _peer_swiglu(SpecsNew, ActNew, "fn")
    assert (new.specs.reduction_n, new.fn_args) == (2, (1.702, 7.0))


def test_routing_logits_give_the_peer_adapts_routing():
    """The peer's router logits built from adapt's permutation: their top-k is adapt's experts of every token, and the
    softmax over the k picked is adapt's routing weights."""
    import torch

    from adapt.kernels.routing import permute_by_expert_torch
    from adapt.stages.bench_moe import _uniform_routing, routing_logits

    torch.manual_seed(3)
    t, e, k = 37, 16, 4
    topw, ids = _uniform_routing(t, e, k, "cpu")
    logits = routing_logits(permute_by_expert_torch(ids, e), topw, e)
    vals, picked = logits.topk(k, dim=-1)
    assert torch.equal(picked.sort(-1).values, ids.long().sort(-1).values)
    got = torch.zeros(t, e).scatter_(1, picked, vals.softmax(-1))
    want = torch.zeros(t, e).scatter_(1, ids.long(), topw)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_time_in_turns_times_every_variant_once_a_round():
    """Rounds go over all variants in order (so a drift falls on each alike), each variant's times in round order."""
    from adapt.bench.timer import Timing, time_in_turns

    calls = []

    def fake_timer(fn, reps):
        calls.append((fn(), reps))
        return Timing(median_us=float(len(calls)), reps=reps, mode="graph")

    got = time_in_turns({"a": lambda: "a", "b": lambda: "b"}, rounds=3, reps=7, timer=fake_timer)
    assert calls == [("a", 7), ("b", 7)] * 3
    assert got == {"a": [1.0, 3.0, 5.0], "b": [2.0, 4.0, 6.0]}


def _fake_events(monkeypatch, calls, run_ms):
    """``torch.cuda.Event`` stubbed in ``adapt.bench.timer``: an event records how many runs ``calls`` holds, and
    the time between two events is the sum of ``run_ms(i)`` over the runs i (1-based) between them."""
    from adapt.bench import timer

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = 0

        def record(self):
            self.at = len(calls)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return float(sum(run_ms(i) for i in range(self.at + 1, end.at + 1)))

    monkeypatch.setattr(timer.torch.cuda, "Event", FakeEvent)
    return timer


def test_timer_warm_up_runs_back_to_back_until_its_device_time(monkeypatch):
    """``timer._warm``: doubling batches of back-to-back runs until about ``warm_ms`` of event time, at most
    WARM_MAX_RUNS runs, none for 0 ms (events stubbed: each run takes 0.5 ms)."""
    calls = []
    timer = _fake_events(monkeypatch, calls, lambda i: 0.5)
    assert timer._warm(lambda: calls.append(1), 0.0) == 0 and not calls
    assert timer._warm(lambda: calls.append(1), 10.0) == 31  # 1 + 2 + 4 + 8 = 15 runs (7.5 ms), then 16 more
    assert len(calls) == 31
    calls.clear()
    assert timer._warm(lambda: calls.append(1), 1e9) == timer.WARM_MAX_RUNS == len(calls)


def test_timer_batched_samples_average_back_to_back_runs(monkeypatch):
    """``timer._batched_times_us``: each sample is one event pair around ``batch`` runs, divided by ``batch``
    (events stubbed: run i takes i ms, so the samples are the batches' means); ``time_cuda`` refuses a batch with
    an L2 flush between runs."""
    import pytest

    calls = []
    timer = _fake_events(monkeypatch, calls, lambda i: i)
    got = timer._batched_times_us(lambda: calls.append(1), 3, 4)
    assert got == [1e3 * (1 + 2 + 3 + 4) / 4, 1e3 * (5 + 6 + 7 + 8) / 4, 1e3 * (9 + 10 + 11 + 12) / 4]
    with pytest.raises(ValueError, match="cannot flush L2"):
        timer.time_cuda(lambda: None, 3, flush_l2=True, batch=4)
