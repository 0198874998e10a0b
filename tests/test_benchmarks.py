"""The benchmark suite's plumbing on tiny shapes (1 repetition): it runs and writes the expected JSON/markdown.

No timing assertions: performance goals live in ``benchmarks/``, not in tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``benchmarks`` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.end_to_end import (  # noqa: E402
    CUDA_ONLY,
    DecodeConfig,
    count_step_events,
    fresh_cache,
    group_static_mask,
    kernel_diff,
    kernel_times,
    run_end_to_end,
    summarize_events,
)
from benchmarks.report import NEEDS_GPU, evaluate_goals, markdown  # noqa: E402

STATUSES = {"met", "miss", "not measured", NEEDS_GPU, "not measured (CPU suite)"}
COMPILED = {"dense compiled", "dense packed compiled", "qada compiled"}
TAIL = {"qada_tail", "qada_tail_budget"}  # the CPU suites' tail-aware rows (issue 23), smoke included
EAGER = {"dense", "dense packed", "qada dense", "qada", "static rho_kv=0.5", "static rho_kv=0.875"} | TAIL


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from benchmarks.run import main

    out = tmp_path_factory.mktemp("bench")
    main(["--smoke", "--out", str(out), "--quiet"])
    return out


def test_smoke_writes_json_and_markdown(smoke):
    data = json.loads((smoke / "smoke-cpu.json").read_text())
    assert {"suite", "command", "machine", "settings", "attention", "overhead", "end_to_end", "goals",
            "models"} <= set(data)  # fmt: skip
    assert data["errors"] == []
    for key in ("cpu", "cores", "torch", "transformers", "qada", "date"):
        assert key in data["machine"]
    assert data["copy_bandwidth"]["bandwidth_gbs"] > 0
    assert data["settings"]["e2e"][0]["batches"] == [1, 2]
    markdown = (smoke / "smoke-cpu.md").read_text()
    for heading in ("## 1.", "## 2.", "## 3-4.", "## 5. Goals", "DynamicCache", "Kernels and host syncs", CUDA_ONLY):
        assert heading in markdown


def test_smoke_rows(smoke):
    data = json.loads((smoke / "smoke-cpu.json").read_text())
    attention = data["attention"]
    assert {r["executor"] for r in attention} == {"dense_sdpa", "sdpa"}
    for row in attention:
        assert {"median", "min", "max", "reps"} <= set(row["timing"])
        assert row["speedup_vs_dense"] > 0
        if row["executor"] != "dense_sdpa":
            assert row["max_abs_err_vs_reference"] < 1e-4
            assert row["kv_sparsity_reported"] == pytest.approx(row["rho_kv"])
    assert {"fraction_stored", "fraction_current", "criterion"} <= set(data["overhead"][0])
    rows = {(r["B"], r["config"]): r for r in data["end_to_end"]}
    # the growing cache's row only at B = 1; every other configuration, eager and compiled, at both batch sizes
    assert set(rows) == {(1, "dense dynamic cache")} | {(B, c) for B in (1, 2) for c in EAGER | COMPILED}
    for B in (1, 2):
        e2e = {c: rows[(B, c)] for c in EAGER | COMPILED}
        assert e2e["dense"]["token_agreement"] == 1.0 and e2e["dense"]["speedup_vs_dense"] == pytest.approx(1.0)
        assert e2e["dense"]["cache"] == "static" and e2e["dense compiled"]["speedup_vs_dense_compiled"] == 1.0
        # the same greedy tokens with qada's wrapper around the dense criterion, packed, and compiled as eager
        assert e2e["qada dense"]["token_agreement"] == 1.0 and e2e["dense compiled"]["token_agreement"] == 1.0
        assert e2e["dense packed"]["token_agreement"] == e2e["dense packed compiled"]["token_agreement"] == 1.0
        assert e2e["dense packed"]["first_step_max_abs_logit_diff"] < 1e-4
        # every row against the fastest unwrapped one, which is one of the four dense rows of this batch size
        best = {r["best_dense"] for r in e2e.values()}
        assert len(best) == 1 and best <= {"dense", "dense packed", "dense compiled", "dense packed compiled"} | (
            {"dense dynamic cache"} if B == 1 else set())
        assert rows[(B, best.pop())]["speedup_vs_best_dense"] == 1.0
        assert all(0 < r["speedup_vs_best_dense"] <= 1.0 for r in e2e.values() if r["config"].startswith("dense"))
        for name in COMPILED:
            row, twin = e2e[name], e2e[name.removesuffix(" compiled")]
            assert row["compiled"] and not twin["compiled"]
            assert row["eager_agreement"] == 1.0 and row["eager_identical_prefix"] == row["tokens_compared"]
            assert row["sparsity"] == pytest.approx(twin["sparsity"])
            assert row["warmup_s"]["median"] > 0 and row["tokens_compared"] == 1 + row["warmup_steps"] + 2
        assert e2e["static rho_kv=0.5"]["kv_sparsity"] == pytest.approx(0.5)
        for name in ("dense", "qada", "dense compiled", "qada compiled"):  # CUDA only: no made-up number
            assert e2e[name]["counters"] == {"status": CUDA_ONLY}
        dense, static = e2e["dense"], e2e["static rho_kv=0.875"]
        assert static["kv_bytes"] < dense["kv_bytes"] and static["weight_bytes"] == dense["weight_bytes"]
    assert rows[(1, "dense dynamic cache")]["cache"] == "dynamic"
    assert rows[(1, "dense dynamic cache")]["token_agreement"] == 1.0
    assert rows[(2, "dense")]["kv_bytes"] == pytest.approx(2 * rows[(1, "dense")]["kv_bytes"])  # per row
    for row in data["end_to_end"]:  # the byte ceiling in every row
        assert {"tokens_per_s_median", "sparsity", "kv_sparsity", "first_step_max_abs_logit_diff", "first_step_s",
                "warmup_s", "t_min_s", "ceiling_fraction", "weight_bytes", "kv_bytes", "model", "B"} <= set(row)
        assert 0 < row["ceiling_fraction"]  # fmt: skip
    assert {g["status"] for g in data["goals"]} <= STATUSES
    gpu_goals = [g for g in data["goals"] if g["goal"].startswith("GPU")]
    assert len(gpu_goals) >= 9 and {g["status"] for g in gpu_goals} == {NEEDS_GPU}


def test_static_group_mask_fraction():
    mask = group_static_mask(30, 9, 3, 0.875)
    groups = mask.view(30, 3, 3)
    assert (groups.all(-1) | ~groups.any(-1)).all()  # whole groups only
    assert groups.all(-1).float().mean().item() == pytest.approx(79 / 90)


def test_event_counts_per_step():
    """Profiler events -> per-step counts: kernels on the device (not memcpy/memset), launches, host waits, DtoH
    copies and scalar reads; one ``.item()`` is one round trip, the harness's device sync is not counted."""
    item = [("aten::item", False), ("aten::_local_scalar_dense", False), ("cudaMemcpyAsync", False),
            ("Memcpy DtoH (Device -> Pinned)", True), ("cudaStreamSynchronize", False)]  # fmt: skip
    step = [("void gemv_kernel<float>", True), ("triton_poi_fused_add_0", True), ("cudaLaunchKernel", False),
            ("cuLaunchKernel", False), ("Memset (Device)", True), ("Memcpy HtoD (Pageable -> Device)", True)]
    counts = summarize_events(2 * step + item + [("cudaGraphLaunch", False), ("cudaDeviceSynchronize", False)], 2)
    assert counts["kernels_per_step"] == 2 and counts["launches_per_step"] == 2
    assert counts["graph_launches_per_step"] == 0.5 and counts["stream_syncs_per_step"] == 0.5
    assert counts["dtoh_copies_per_step"] == 0.5 and counts["item_per_step"] == 0.5
    assert counts["local_scalar_dense_per_step"] == 0.5 and counts["host_round_trips_per_step"] == 0.5
    assert summarize_events(step, 1)["host_round_trips_per_step"] == 0


def test_kernel_times_per_step():
    """Profiled device kernels -> per-step time by kernel name (longest first), the span and the busy fraction."""
    kernels = [("split", 0.0, 6.0), ("combine", 8.0, 9.0), ("split", 10.0, 16.0), ("combine", 18.0, 19.0),
               ("gemv", 20.0, 20.0)]  # fmt: skip
    times = kernel_times(kernels, 2)
    assert times["kernel_us_per_step"] == 7.0 and times["span_us_per_step"] == 10.0 and times["busy"] == 0.7
    assert [k["name"] for k in times["by_kernel"]] == ["split", "combine", "gemv"]
    assert times["by_kernel"][0] == {"name": "split", "per_step": 1.0, "us_per_step": 6.0}
    assert kernel_times([], 3) == {"kernel_us_per_step": 0.0, "span_us_per_step": 0.0, "busy": None, "by_kernel": []}


def test_kernel_diff_against_dense():
    """The kernels a row runs beyond dense's: new ones positive, dropped ones negative, unchanged ones left out."""
    dense = [{"name": "sdpa", "per_step": 30.0, "us_per_step": 90.0}, {"name": "mm", "per_step": 60.0,
                                                                       "us_per_step": 500.0}]
    row = [{"name": "split", "per_step": 30.0, "us_per_step": 150.0}, {"name": "combine", "per_step": 30.0,
                                                                        "us_per_step": 40.0},
           {"name": "mm", "per_step": 60.0, "us_per_step": 500.4}]  # fmt: skip
    diff = kernel_diff(row, dense)
    assert [(k["name"], k["per_step"], k["us_per_step"]) for k in diff] == [
        ("split", 30.0, 150.0), ("sdpa", -30.0, -90.0), ("combine", 30.0, 40.0)]
    assert kernel_diff(row, dense, top=1)[0]["name"] == "split"


def test_report_shows_kernel_times():
    """The report's section on device time by kernel, from counters as a GPU run writes them."""
    from benchmarks.end_to_end import _extra_kernels
    from benchmarks.report import _kernel_time_section

    base = {"host_round_trips_per_step": 0.0, "layers": 30, "launches_per_step": 3.0, "graph_launches_per_step": 1.0,
            "stream_syncs_per_step": 0.0, "dtoh_copies_per_step": 0.0, "item_per_step": 0.0,
            "local_scalar_dense_per_step": 0.0}  # fmt: skip
    dense = base | {"kernels_per_step": 60.0} | kernel_times([("sdpa", 0.0, 3.0), ("mm", 3.0, 5.0)] * 30, 1)
    fused = base | {"kernels_per_step": 90.0} | kernel_times(
        [("qada_fused_split_kernel", 0.0, 4.0), ("qada_decode_combine_kernel", 4.0, 5.0), ("mm", 5.0, 7.0)] * 30, 1)
    rows = [_row("dense compiled", 7680, 1, "smollm2", 400.0, counters=dense),
            _row("qada fused compiled", 7680, 1, "smollm2", 300.0, counters=fused)]
    _extra_kernels(rows)
    assert rows[1]["counters"]["extra_kernels_per_layer"] == 1.0
    text = _kernel_time_section(rows)
    assert "### Device time per decode step, by kernel" in text
    assert "`qada_fused_split_kernel` +30 / +120 us" in text and "`sdpa` -30 / -90 us" in text


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import tiny_model

    torch.manual_seed(0)
    return tiny_model("llama")


def test_step_counters_say_not_applicable_off_cuda(tiny):
    """On the CPU the counter function runs nothing and returns the marker, never a number."""
    base = [(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)) for _ in range(2)]
    cache = fresh_cache(tiny, base, "static", 64, batch=2)
    assert cache.get_seq_length() == 40
    counts = count_step_events(tiny, cache, torch.tensor([1, 2]), 40, steps=3)
    assert counts == {"status": CUDA_ONLY}
    assert cache.get_seq_length() == 40  # no step ran


def test_a_failing_configuration_is_recorded_and_the_others_measured(tiny):
    """A run that cannot be built, and a compiled configuration whose run is not graph-capturable (the ``flex``
    executor declares no ``static_shapes``): each row records its error, the others are measured."""
    from qada.models import build_run

    def broken():
        raise RuntimeError("no such run")

    def make():
        return [(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)) for _ in range(2)], [3]

    configs = {"dense": DecodeConfig(count_events=True), "broken": DecodeConfig(make_run=broken),
               "flex compiled": DecodeConfig(make_run=lambda: build_run("dense", "none", "flex"), compiled=True),
               "qada dense": DecodeConfig(make_run=lambda: build_run("dense", "none", "sdpa"))}  # fmt: skip
    rows = run_end_to_end(tiny, {(40, 1): make}, lambda B: configs, steps=2, reps=1, device="cpu",
                          log=lambda *a: None, model_name="tiny")  # fmt: skip
    by = {r["config"]: r for r in rows}
    assert set(by) == set(configs)
    assert "no such run" in by["broken"]["error"] and "not graph-capturable" in by["flex compiled"]["error"]
    assert by["qada dense"]["token_agreement"] == 1.0 and by["dense"]["counters"] == {"status": CUDA_ONLY}
    skipped = {"model": "tiny", "T": 131072, "B": 8, "config": "*", "skipped": "needs ~146 GiB for its caches"}
    text = markdown({"suite": "smoke", "command": "x", "machine": {"cpu": "c"}, "end_to_end": rows + [skipped],
                     "models": {"tiny": "tiny"}})  # fmt: skip
    assert "FAILED: RuntimeError('no such run')" in text and "skipped: needs ~146 GiB" in text


def failing_at_second_repetition(error: BaseException):
    """A ``make_run`` whose run raises ``error`` when its second repetition starts (its second ``reset_stats``)."""
    from qada.models import build_run

    calls = []

    def make_run():
        run = build_run("dense", "none", "sdpa")
        reset = run.reset_stats

        def reset_stats():
            calls.append(1)
            if len(calls) > 1:
                raise error
            reset()

        run.reset_stats = reset_stats
        return run

    return make_run


def test_a_configuration_failing_at_a_later_repetition_keeps_what_it_measured(tiny):
    """A failure at the second repetition (on a GPU a device error stops every configuration there) keeps the
    first repetition's measurements in the row, and the row's error says after how many repetitions it failed."""
    flaky_run = failing_at_second_repetition(RuntimeError("device lost"))

    def make():
        return [(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)) for _ in range(2)], [3]

    configs = {"dense": DecodeConfig(), "flaky": DecodeConfig(make_run=flaky_run)}
    rows = run_end_to_end(tiny, {(40, 1): make}, lambda B: configs, steps=2, reps=2, device="cpu",
                          log=lambda *a: None, model_name="tiny")  # fmt: skip
    by = {r["config"]: r for r in rows}
    assert by["dense"]["reps"] == 2 and "error" not in by["dense"]
    flaky = by["flaky"]
    assert flaky["reps"] == 1 and flaky["tokens_per_s_median"] > 0 and flaky["token_agreement"] == 1.0
    assert flaky["error"].startswith("failed after 1 of 2 repetitions") and "device lost" in flaky["error"]
    text = markdown({"suite": "smoke", "command": "x", "machine": {"cpu": "c"}, "end_to_end": rows,
                     "models": {"tiny": "tiny"}})  # fmt: skip
    assert "FAILED" not in text and " x1 |" in text


def test_an_interrupted_case_saves_the_repetitions_done_then_stops(tiny):
    """A stage's time limit (``timeout --signal=INT``: a KeyboardInterrupt) in the second repetition: the case's rows
    are built from the first repetition of every configuration and handed to ``on_case`` (saved), each row saying
    it was interrupted, and the interrupt goes on (the run stops)."""
    interrupted_run = failing_at_second_repetition(KeyboardInterrupt())

    def make():
        return [(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)) for _ in range(2)], [3]

    configs = {"dense": DecodeConfig(), "cut": DecodeConfig(make_run=interrupted_run)}
    saved = []
    with pytest.raises(KeyboardInterrupt):
        run_end_to_end(tiny, {(40, 1): make, (48, 1): make}, lambda B: configs, steps=2, reps=3, device="cpu",
                       log=lambda *a: None, model_name="tiny", on_case=saved.append)  # fmt: skip
    assert len(saved) == 1  # the first case, not the second
    by = {r["config"]: r for r in saved[0]}
    assert by["cut"]["reps"] == 1 and by["cut"]["tokens_per_s_median"] > 0
    assert by["cut"]["error"].startswith("failed after 1 of 3 repetitions: interrupted (KeyboardInterrupt")
    assert by["dense"]["reps"] == 2 and by["dense"]["error"].startswith("failed after 2 of 3 repetitions")


def test_a_layer_step_that_fell_back_to_eager_is_said_in_its_row(tiny):
    """A configuration asked to compile whose layer step cannot (here: streaming moments in blocks read the host)
    runs eagerly; its row says so, with the reason, and the report marks it."""
    import warnings

    from qada.models import build_run

    def make():
        return [(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)) for _ in range(2)], [3]

    configs = {"dense": DecodeConfig(),
               "qada blocks": DecodeConfig(make_run=lambda: build_run(
                   {"name": "qada", "tau": 0.3}, {"name": "current", "update_every": 4}, "sdpa", compile="eager")),
               "qada eager": DecodeConfig(make_run=lambda: build_run({"name": "qada", "tau": 0.3}, "current", "sdpa",
                                                                     compile=False))}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's own warning
        rows = run_end_to_end(tiny, {(40, 1): make}, lambda B: configs, steps=2, reps=1, device="cpu",
                              log=lambda *a: None, model_name="tiny")  # fmt: skip
    by = {r["config"]: r for r in rows}
    assert by["qada blocks"].get("layer_step_eager")  # the reason (Dynamo's words)
    assert "layer_step_eager" not in by["qada eager"] and "layer_step_eager" not in by["dense"]  # not asked to compile
    text = markdown({"suite": "smoke", "command": "x", "machine": {"cpu": "c"}, "end_to_end": rows,
                     "models": {"tiny": "tiny"}})  # fmt: skip
    assert "qada blocks (layer step eager!)" in text and "qada eager (layer step eager!)" not in text


def _row(config, T, B, model, tps, **extra):
    return {"config": config, "T": T, "B": B, "model": model, "tokens_per_s_median": tps, "sparsity": 0.5,
            "kv_sparsity": 0.4, "seconds_per_token": {"median": B / tps}, "compiled": "compiled" in config, **extra}


def test_gpu_goals_from_measured_rows():
    """The issue's GPU goals read the measured rows on a GPU; without one they are "not measured (needs a GPU)"."""
    counters = {"kernels_per_step": 900.0, "host_round_trips_per_step": 1.0, "layers": 30}
    rows = [
        _row("dense compiled", 7680, 32, "smollm2", 1000.0, speedup_vs_dense_compiled=1.0, counters=dict(counters)),
        _row("qada compiled", 7680, 32, "smollm2", 2500.0, speedup_vs_dense_compiled=2.5, eager_agreement=1.0,
             counters=counters | {"extra_kernels_per_layer": 4.0, "extra_round_trips_per_step": 0.0}),
        _row("qada", 7680, 32, "smollm2", 300.0,
             counters=counters | {"extra_kernels_per_layer": 7.5, "extra_round_trips_per_step": 1.0}),
        _row("qada compiled", 7680, 1, "smollm2", 80.0, speedup_vs_dense_compiled=0.8),
        _row("static rho_kv=0.875 compiled", 131072, 1, "llama3-8b-random", 30.0, speedup_vs_dense_compiled=2.2),
        _row("qada dense", 131072, 1, "llama3-8b-random", 10.0, ceiling_fraction=0.42, t_min_s=0.042),
    ]  # fmt: skip
    results = {"suite": "gpu", "machine": {"gpu": "NVIDIA H100 80GB HBM3"}, "end_to_end": rows}
    goals = {g["goal"]: g for g in evaluate_goals(results)}

    def status(words: str) -> str:
        (match,) = [g for name, g in goals.items() if all(w in name for w in words.split("|"))]
        return match["status"]

    assert status("SmolLM2|B=32: graph-captured QAdA tau 0.6 / compiled") == "met"
    assert status("SmolLM2|B=1: graph-captured QAdA tau 0.6 / compiled") == "miss"
    assert status("graph-captured forced rho_kv=0.875") == "met"
    assert status("GPU|dense criterion") == "miss"
    assert status("host round trips") == "miss" and status("extra kernels per layer|worst case") == "miss"
    assert goals["GPU: extra kernels per layer and decode step (qada vs dense, eager and compiled, worst case)"][
        "measured"] == 7.5  # fmt: skip
    assert status("mixed path at rho_kv=0.875, T=32768") == "not measured"  # no attention rows in this run
    assert status("CPU: qada decode tokens/s at ~8k") == "not measured (CPU suite)"
    on_cpu = evaluate_goals({"suite": "gpu-dryrun", "machine": {"gpu": None}, "end_to_end": rows})
    assert {g["status"] for g in on_cpu if g["goal"].startswith("GPU")} == {NEEDS_GPU}


def _parity_row(executor, unexplained=0, near_tau=0, moments="stored", **extra):
    reference = {"prompt": "random_words", "file": "reference.safetensors", "fingerprint": "abc"}
    return dict(criterion="qada", tau=0.6, moments=moments, executor=executor, compiled=False, device="cuda",
                length=2048, tokens=8, decisions=2160, mismatched=near_tau + unexplained, near_tau=near_tau,
                unexplained=unexplained, missing=0, equal=unexplained == 0, sparsity_cpu=0.70,
                sparsity_device=0.70 + 0.001 * unexplained, reference_cpu=reference, reference_device=reference,
                same_reference=True, seconds=1.0) | extra  # fmt: skip


def test_parity_goal_reads_the_worst_case_and_a_failed_case_leaves_it_unmeasured():
    """The parity section's goal: the most unexplained mismatches of any case, 0 to meet it; near-tau mismatches
    do not count; a failed case leaves it not measured (never met); off a GPU it needs one."""
    from benchmarks.report import _parity_section

    gpu = {"suite": "gpu", "machine": {"gpu": "NVIDIA H200"}}

    def parity_goal(rows, machine=gpu):
        (found,) = [g for g in evaluate_goals(machine | {"parity": rows}) if "decisions on CUDA equal" in g["goal"]]
        return found

    met = parity_goal([_parity_row("triton", near_tau=3), _parity_row("triton_fused", moments="current")])
    assert (met["measured"], met["status"]) == (0, "met")
    assert "2 cases" in met["detail"] and "3 near tau" in met["detail"] and "triton, triton_fused" in met["detail"]
    missed = parity_goal([_parity_row("triton"), _parity_row("triton_fused", unexplained=4, near_tau=1)])
    assert (missed["measured"], missed["status"]) == (4, "miss")
    failed = parity_goal([_parity_row("triton"), {k: v for k, v in _parity_row("triton_fused").items()
                                                  if k in ("criterion", "tau", "moments", "executor", "compiled",
                                                           "device", "length", "tokens")} | {"error": "boom"}])
    assert failed["measured"] is None and failed["status"] == "not measured (1 of 2 cases failed)"
    assert parity_goal([_parity_row("triton")], {"suite": "gpu-dryrun", "machine": {"gpu": None}})["status"] == \
        NEEDS_GPU  # fmt: skip
    text = _parity_section([_parity_row("triton", unexplained=2), {"criterion": "qada_tail", "tau": 0.3,
                            "moments": "current", "executor": "triton", "compiled": True, "device": "cuda",
                            "length": 2048, "tokens": 8, "error": "boom"}])  # fmt: skip
    lines = [line for line in text.splitlines() if line.startswith("| qada")]
    assert len(lines) == 2 and "| 2 |" in lines[0] and "same on the CPU" in lines[0]
    assert "FAILED: boom" in lines[1] and "triton compiled" in lines[1]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_issue33_gpu_goals_from_measured_rows():
    """Issue 33's goals: QAdA's sparsity against the committed CPU suite's, the fused decision's speed and kernels,
    qada_tail against qada, the tail budget at 128k against qada's dense path, triton's dense path at bandwidth."""
    from benchmarks.report import _cpu_suite_row

    cpu = _cpu_suite_row("qada", 7680)
    assert cpu is not None and 0 < cpu["sparsity"] < 1  # the committed CPU suite holds the row compared with
    fused_counters = {"kernels_per_step": 700.0, "host_round_trips_per_step": 0.0, "layers": 30,
                      "extra_kernels_per_layer": 5.0, "extra_round_trips_per_step": 0.0}  # fmt: skip
    rows = [
        _row("qada", 7680, 1, "smollm2", 20.0) | {"sparsity": cpu["sparsity"] + 0.01},
        _row("qada fused compiled", 7680, 32, "smollm2", 2100.0, speedup_vs_dense_compiled=2.1,
             counters=fused_counters),
        _row("qada fused compiled", 7680, 1, "smollm2", 50.0, speedup_vs_dense_compiled=0.5),
        _row("qada fused wide compiled", 7680, 32, "smollm2", 2400.0, speedup_vs_dense_compiled=2.4),
        _row("qada fused once compiled", 7680, 32, "smollm2", 1900.0, speedup_vs_dense_compiled=1.9),
        _row("qada compiled", 7680, 1, "smollm2", 80.0, speedup_vs_dense_compiled=0.8),
        _row("qada_tail compiled", 7680, 1, "smollm2", 76.0, speedup_vs_dense_compiled=0.76),
        _row("qada_tail fused compiled", 7680, 1, "smollm2", 47.0, speedup_vs_dense_compiled=0.47),
        _row("qada_tail fused once compiled", 7680, 1, "smollm2", 45.0, speedup_vs_dense_compiled=0.45),
        _row("qada_tail fused once together compiled", 7680, 1, "smollm2", 40.0, speedup_vs_dense_compiled=0.40),
        _row("qada_tail_budget compiled", 131072, 1, "llama3-8b-random", 42.0, speedup_vs_dense_compiled=4.2),
        _row("qada_tail_budget fused compiled", 131072, 1, "llama3-8b-random", 40.0, speedup_vs_dense_compiled=4.0),
        _row("qada dense compiled", 131072, 1, "llama3-8b-random", 30.0, speedup_vs_dense_compiled=3.0),
    ]  # fmt: skip
    attention = [{"shape": "llama3-8b-layer", "T": 32768, "executor": "triton", "local_groups": 0, "rho_kv": 0.0,
                  "timing": {"median": 1.0}, "graphed_bandwidth_gbs": 2500.0},
                 {"shape": "llama3-8b-layer-b8", "T": 131072, "executor": "triton", "local_groups": 0, "rho_kv": 0.0,
                  "timing": {"median": 1.0}, "graphed_bandwidth_gbs": 2100.0}]  # fmt: skip
    sweep = [{"shape": "llama3-8b-layer", "T": 32768, "setting": {"block_size": 128}, "graphed_bandwidth_gbs": 2700.0}]
    results = {"suite": "gpu", "machine": {"gpu": "H100"}, "end_to_end": rows, "attention": attention,
               "dense_sweep": sweep, "copy_bandwidth": {"bandwidth_gbs": 3000.0}}  # fmt: skip
    goals = {g["goal"]: g for g in evaluate_goals(results)}

    def goal(words: str) -> dict:
        (match,) = [g for name, g in goals.items() if all(w in name for w in words.split("|"))]
        return match

    assert goal("sparsity on SmolLM2")["status"] == "met"
    assert goal("sparsity on SmolLM2")["measured"] == pytest.approx(0.01)
    # without the eager row, its compiled twin's sparsity (the same decisions) is compared
    only_compiled = [r for r in rows if r["config"] != "qada"]
    only_compiled[[r["config"] for r in only_compiled].index("qada compiled")]["sparsity"] = cpu["sparsity"] - 0.03
    (sparsity,) = [g for g in evaluate_goals(results | {"end_to_end": only_compiled})
                   if "sparsity on SmolLM2" in g["goal"]]
    assert sparsity["status"] == "miss" and sparsity["measured"] == pytest.approx(0.03)
    assert "qada compiled" in sparsity["detail"]
    assert goal("B=32|triton_fused) / compiled dense")["status"] == "met"
    assert goal("B=1:|triton_fused) / compiled dense")["status"] == "miss"
    assert goal("B=32|triton_fused) / compiled dense")["measured"] == pytest.approx(2.1)  # the default row's
    assert goal("B=32|triton_fused) / compiled dense")["detail"].endswith("; variants: once 1.90, wide 2.40")
    assert "variants" not in goal("B=1:|triton_fused) / compiled dense")["detail"]  # none measured at B = 1
    assert goal("B=1:|qada_tail tau 0.3 / qada|compiled layer step")["measured"] == pytest.approx(0.95)
    assert goal("B=32|qada_tail tau 0.3 / qada|compiled layer step")["status"] == "not measured"  # no rows at B = 32
    assert goal("B=1:|qada_tail tau 0.3 / qada|in the kernel")["measured"] == pytest.approx(0.94)
    # the variants of the qada_tail fused row, against qada fused (0.5): the default row stays the goal's
    assert goal("B=1:|qada_tail tau 0.3 / qada|in the kernel")["detail"] == "variants: once 0.90, once together 0.80"
    assert not goal("B=32|qada_tail tau 0.3 / qada|in the kernel")["detail"]  # (none at B = 32)
    assert goal("qada_tail_budget 0.85 / qada's own")["measured"] == pytest.approx(1.4)  # the faster of the two
    assert "qada_tail_budget compiled," in goal("qada_tail_budget 0.85 / qada's own")["detail"]
    assert goal("qada_tail_budget 0.85 / qada's own")["status"] == "miss"
    assert goal("qada_tail_budget 0.85 / transformers")["status"] == "met"
    bandwidth = goal("every group dense, graph-captured")
    assert bandwidth["measured"] == pytest.approx(0.7) and bandwidth["status"] == "miss"  # the worst: B = 8, 128k
    assert "90%" in bandwidth["detail"]  # the best swept setting
    kernels = goal("extra kernels|decision in the kernel")
    assert kernels["measured"] == 5.0 and kernels["status"] == "met"


def test_gpu_suite_dry_run_covers_every_gpu_case(tmp_path):
    """``--gpu --dry-run``: the GPU suite's code on the CPU (Triton in the interpreter), tiny shapes: SmolLM2's
    real weights (first 2 layers) on real pass-key prompts at B = 2, a tiny random model standing in for the
    Llama-3-8B shapes, eager and compiled rows, the counters saying n/a."""
    from benchmarks.run import main

    main(["--gpu", "--dry-run", "--out", str(tmp_path), "--quiet"])
    data = json.loads((tmp_path / "gpu-dryrun-cpu.json").read_text())
    assert data["errors"] == []
    assert {r["executor"] for r in data["attention"]} >= {"dense_sdpa", "sdpa", "flex", "triton"}
    assert set(data["models"]) == {"smollm2", "tiny-random"} and "real weights" in data["models"]["smollm2"]
    rows = {(r["model"], r["B"], r["config"]): r for r in data["end_to_end"]}
    eager = EAGER - {"static rho_kv=0.5"}
    twins = {f"{name} eager" for name in {"qada"} | TAIL}  # compile=False: the same layer step, eagerly
    fused = {f"{name} fused{once}" for name in ("qada", "qada_tail") for once in ("", " once")}  # triton suites
    fused |= {"qada_tail_budget fused"}  # (a budget's decision is always a launch of its own: no "once" twin)
    lean = {"qada_tail+E/lean", "qada_tail+E/lean fused", "qada_tail+E/lean fused once"}  # (compiled: GPU only)
    graphed = {f"{name} compiled" for name in ("dense", "dense packed", "qada dense", "qada", "qada fused")}  # graphs
    assert {("smollm2", 2, c) for c in eager | fused | graphed | twins | {f"{t} compiled" for t in TAIL}
            | {"qada_tail fused compiled", "qada fused once compiled", "qada_tail fused once compiled",
               "qada_tail_budget fused compiled"} | lean} == {k for k in rows if k[0] == "smollm2"}
    random_rows = eager | fused | graphed | {"dense dynamic cache", "qada_tail fused compiled",
                                             "qada_tail fused once compiled", "qada_tail_budget compiled",
                                             "qada_tail_budget fused compiled", "static rho_kv=0.875 compiled",
                                             "qada_tail_budget/group fused", "qada_tail_budget/group fused compiled",
                                             "qada_tail_budget/group fused wide",
                                             "qada_tail_budget/group fused wide compiled",
                                             "qada_tail_budget/group fused together",
                                             "qada_tail_budget/group fused together compiled",
                                             "qada_tail fused once together", "qada_tail fused once together compiled"}
    assert {("tiny-random", 1, c) for c in random_rows} == {k for k in rows if k[0] == "tiny-random"}
    group = rows[("tiny-random", 1, "qada_tail_budget/group fused")]  # whole KV groups local: every local head's
    assert group["kv_sparsity"] == pytest.approx(group["sparsity"]) and group["sparsity"] > 0  # group skips its bulk
    for name in ("qada", "qada_tail", "qada_tail_budget"):  # the same decisions in the kernel
        for fused_name in {f"{name} fused", f"{name} fused once"} & fused:
            fused_sparsity = rows[("smollm2", 2, fused_name)]["sparsity"]
            assert fused_sparsity == pytest.approx(rows[("smollm2", 2, name)]["sparsity"])
    for key in ("sparsity", "kv_read"):  # the accurate configuration, decided in the kernels as by its torch step
        for fused_name in ("qada_tail+E/lean fused", "qada_tail+E/lean fused once"):
            assert rows[("smollm2", 2, fused_name)][key] == pytest.approx(rows[("smollm2", 2, "qada_tail+E/lean")][key])
    parity = {(r["criterion"], r["moments"], r["executor"]): r for r in data["parity"]}  # the CPU against itself
    assert set(parity) == {(c, m, e) for c in ("qada", "qada_tail") for m in ("stored", "current")
                           for e in ("triton", "triton_fused", "triton_fused estimating")
                           if c == "qada" or e != "triton_fused estimating"}  # fmt: skip
    assert all(r["equal"] and r["decisions"] > 0 and "error" not in r for r in parity.values())
    assert all(r["same_reference"] and r["reference_device"]["file"].endswith(".safetensors")
               for r in parity.values() if r["moments"] == "stored")  # fmt: skip
    stored = rows[("smollm2", 2, "qada")]["run"]["moments"]  # the CPU suites' source, its reference named
    assert stored["name"] == "stored" and stored["prompt"] == "random_words"
    assert stored["file"].endswith(".safetensors") and len(stored["fingerprint"]) == 16
    assert rows[("tiny-random", 1, "qada")]["run"]["moments"] == {"name": "current"}  # random weights
    assert 0 < rows[("smollm2", 2, "qada")]["kv_read"] <= 1
    for key, row in rows.items():
        assert "error" not in row, (key, row.get("error"))
        assert row["cache"] == ("dynamic" if "dynamic" in key[2] else "static") and "t_min_s" in row
        if row["compiled"]:
            assert "eager_agreement" in row
        if key[2] in ("dense", "qada", "dense compiled", "qada compiled"):
            assert row["counters"] == {"status": CUDA_ONLY}
    assert 0 < rows[("smollm2", 2, "qada")]["sparsity"] < 1
    for name in twins:  # the same decisions as the compiled step
        compiled = rows[("smollm2", 2, name.removesuffix(" eager"))]["sparsity"]
        assert rows[("smollm2", 2, name)]["sparsity"] == pytest.approx(compiled)
    assert {g["status"] for g in data["goals"] if g["goal"].startswith("GPU")} == {NEEDS_GPU}


def test_configs_pick_rows_and_keep_the_dense_reference():
    """``--configs``: only the named end-to-end rows, ``dense`` (the reference of every ratio) always; an unknown
    name is an error naming the known ones."""
    from benchmarks.run import pick_configs

    build = lambda batch: {"dense": 0, "qada": 1, "qada compiled": 2, f"B{batch}": 3}  # noqa: E731
    assert pick_configs(None, build, 1) == build(1)
    assert pick_configs("qada compiled", build, 1) == {"dense": 0, "qada compiled": 2}
    with pytest.raises(ValueError, match=r"--configs: \['nope'\] not among"):
        pick_configs("qada,nope", build, 1)


def test_a_row_says_when_its_layer_step_ran_eagerly():
    """A configuration whose layer step fell back to eager is flagged; the fused step's eager default (its kernels
    run alike, and a CUDA graph replays them), the dense step's two launches and Triton's interpreter are named
    without the alarm."""
    from benchmarks.report import _e2e_cells
    from qada.models.layer_step import DENSE_STEP_EAGER, FUSED_STEP_EAGER, INTERPRETED_STEP_EAGER

    row = {"config": "qada fused compiled", "T": 7680, "B": 1, "skipped": "(the label only)"}
    assert _e2e_cells(row)[2] == "qada fused compiled"
    assert _e2e_cells(row | {"layer_step_eager": FUSED_STEP_EAGER})[2] == "qada fused compiled (layer step eager)"
    assert _e2e_cells(row | {"layer_step_eager": INTERPRETED_STEP_EAGER})[2].endswith("(layer step eager)")
    assert _e2e_cells(row | {"layer_step_eager": DENSE_STEP_EAGER})[2].endswith("(layer step eager)")
    fallback = row | {"layer_step_eager": "SubprocException: ..."}
    assert _e2e_cells(fallback)[2] == "qada fused compiled (layer step eager!)"


@pytest.mark.parametrize("name", ["qada fused inductor", "qada fused pdl", "qada_tail fused pdl",
                                  "qada_tail fused spread", "qada_tail_budget/group fused", "qada fused wide",
                                  "qada fused once wide", "qada_tail fused wide", "qada_tail_budget/group fused wide",
                                  "qada_tail_budget/group fused together", "qada_tail+E/lean fused uncapped",
                                  "qada_tail fused splits", "qada fused unspread", "qada_tail fused unspread",
                                  "qada fused estimating"])
def test_fused_variant_rows_only_where_a_workload_names_them(name):
    """The fused variants (``inductor``: ``compile_step=True``; ``pdl``: programmatic dependent launches; ``spread``:
    narrow page-top programs; ``/group``: the budget over whole KV groups; ``wide``: splits for more programs per
    SM; ``uncapped``: no register cap; ``together``: the budget's scores one program per KV head; ``unspread``:
    the moment step one program per (row, KV head)), built only where
    the workload's compiled rows name them: the GPU suite (SmolLM2's, or the Llama-3-8B shapes' for the group
    budget), not its dry run, where each would be its plain ``fused`` row again."""
    from dataclasses import replace

    from tiny_models import tiny_model

    from benchmarks.models import build_configs
    from benchmarks.suites import (
        DRY_RUN_COMPILED,
        FUSED_VARIANTS,
        LLAMA8B_CASES,
        SMOLLM2_GPU,
        SPREAD_PAGES,
        SUITES,
        WIDE_PROGRAMS,
        Workload,
    )

    suite = replace(SUITES["gpu-dryrun"], e2e_executor="triton")
    model = tiny_model("llama")
    named = Workload("tiny-random", (64,), compiled=(name,), tail=True, moments="current")
    configs = build_configs(suite, named, model, None, 1)
    assert {name, f"{name} compiled"} <= set(configs)
    run = configs[name].make_run()
    criterion, executor = FUSED_VARIANTS[name]
    criterion = criterion if isinstance(criterion, str) else criterion["name"]
    assert run.criterion.registry_name == criterion and run.executor.registry_name == "triton_fused"
    assert run.executor.compile_step is name.endswith("inductor") and run.executor.pdl is name.endswith("pdl")
    assert run.executor.spread_moments is not name.endswith("unspread")
    assert run.executor.estimate_in_splits is name.endswith("estimating")
    if name.endswith("unspread"):  # (the plain row's decision: qada's in the splits, qada_tail's by default)
        assert run.executor.decide_once is FUSED_VARIANTS[name][1].get("decide_once")
    else:
        assert run.executor.decide_once is (None if "/group" in name or "/lean" in name
                                            else name.endswith(" spread") or " once " in name)
    assert run.executor.cap_registers is not name.endswith("uncapped")
    assert run.executor.programs_per_sm == (WIDE_PROGRAMS if name.endswith("wide") else 2)
    assert run.executor.pages_per_program == (SPREAD_PAGES if name.endswith(" spread") else 256)
    assert run.executor.heads_apart is (False if name.endswith("together") else None)
    assert getattr(run.criterion, "per_group", False) is ("/group" in name)
    assert name not in build_configs(suite, replace(named, compiled=()), model, None, 1)
    assert name in (LLAMA8B_CASES if "/group" in name else SMOLLM2_GPU).compiled and name not in DRY_RUN_COMPILED


def test_plain_fused_rows_run_the_executor_with_its_defaults():
    """``qada fused`` and ``qada_tail fused`` (the goals' rows) are what a user gets from ``triton_fused``: no launch
    setting given, so ``qada_tail`` decides once above ``pages_per_program`` bounded pages (SmolLM2 at 7,680 tokens)
    and in the splits below; their ``once`` twins force ``decide_once=True``."""
    from dataclasses import replace

    from tiny_models import tiny_model

    from benchmarks.models import build_configs
    from benchmarks.suites import SUITES, Workload
    from qada.models import build_run

    suite = replace(SUITES["gpu-dryrun"], e2e_executor="triton")
    workload = Workload("tiny-random", (64,), compiled=(), tail=True, moments="current")
    configs = build_configs(suite, workload, tiny_model("llama"), None, 1)
    defaults = build_run(criterion="qada", executor="triton_fused").describe()["executor"]
    assert defaults["name"] == "triton_fused" and defaults["decide_once"] is None
    for name in ("qada fused", "qada_tail fused", "qada_tail_budget fused"):
        assert configs[name].make_run().describe()["executor"] == defaults, name
    for name in ("qada fused once", "qada_tail fused once"):
        assert configs[name].make_run().executor.decide_once is True


def test_interleaved_configurations_parse():
    from benchmarks.interleaved import CRITERIA, NO_AHEAD, NO_PASS, OWN_WINDOW, main, parse_config

    with pytest.raises(SystemExit):  # the same name twice (a replica needs a '#' tag)
        main(["--configs", "qada compiled,qada compiled"])

    plain = {"small_matmul": True, "ahead": True, "step_window": True}
    assert parse_config("dense packed compiled") == {"criterion": None, "packed": True, "compiled": True, **plain}
    assert parse_config("dense") == {"criterion": None, "packed": False, "compiled": False, **plain}
    assert parse_config("qada dense") == {"criterion": {"name": "dense"}, "compiled": False, **plain}
    assert parse_config(f"qada_tail compiled {NO_PASS}") == {"criterion": CRITERIA["qada_tail"], "compiled": True,
                                                             **plain, "small_matmul": False}
    assert parse_config(f"qada compiled {NO_AHEAD}") == {"criterion": CRITERIA["qada"], "compiled": True,
                                                         **plain, "ahead": False}
    assert parse_config(f"qada {NO_AHEAD} {NO_PASS}") == {"criterion": CRITERIA["qada"], "compiled": False,
                                                          **plain, "small_matmul": False, "ahead": False}
    assert parse_config(f"qada_tail compiled {OWN_WINDOW}") == {"criterion": CRITERIA["qada_tail"],
                                                                "compiled": True, **plain, "step_window": False}
    assert parse_config("qada") == {"criterion": CRITERIA["qada"], "compiled": False, **plain}
    assert parse_config("qada compiled #2") == parse_config("qada compiled")  # a replica: its own model copy
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_config("quest compiled")
    with pytest.raises(ValueError, match="no layer step"):
        parse_config(f"dense packed {NO_PASS}")
    with pytest.raises(ValueError, match="no layer step"):
        parse_config(f"dense packed compiled {NO_AHEAD}")
    with pytest.raises(ValueError, match="no layer step"):
        parse_config(f"dense packed {OWN_WINDOW}")


@pytest.mark.slow
def test_interleaved_steps_write_their_ratios(tmp_path):
    """The embedded model at 256 tokens, two eager-model configurations (the second's layer step compiled without
    the small-matmul pass), 2 rounds in each of 2 rotations of the build order: both rows, the reference's ratio 1,
    a ratio per rotation, the run's sparsity."""
    from benchmarks.interleaved import main

    out = tmp_path / "ab"
    assert main(["--length", "256", "--steps", "2", "--warmup", "1", "--configs",
                 "dense packed,qada no small-matmul pass", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {row["config"]: row for row in result["rows"]}
    assert rows["dense packed"]["ratio_to_first"] == 1.0 and rows["dense packed"]["sparsity"] is None
    assert result["rotations"] == 2 and rows["dense packed"]["ratio_per_rotation"] == [1.0, 1.0]
    assert len(rows["qada no small-matmul pass"]["ratio_per_rotation"]) == 2
    assert rows["qada no small-matmul pass"]["median_ms"] > 0
    assert 0.0 <= rows["qada no small-matmul pass"]["sparsity"] <= 1.0
    assert "x dense packed" in out.with_suffix(".md").read_text()


def test_lean_configurations_are_read_lean_with_attend_exact():
    """``benchmarks/dispatch_count.py`` (whose spelling ``benchmarks/launch_bytes.py`` takes),
    ``benchmarks/kernel_resources.py`` (no torch import at their top) and the GPU suite spell the accurate
    configuration out: it must stay ``READ_LEAN`` with ``attend_exact``, as ``benchmarks/interleaved.py`` builds it."""
    from benchmarks.dispatch_count import LEAN
    from benchmarks.interleaved import CRITERIA
    from benchmarks.kernel_resources import CONFIGS
    from benchmarks.launch_bytes import CONFIGS as BYTE_CONFIGS
    from benchmarks.suites import LEAN_TAIL
    from qada.criteria import READ_LEAN

    assert LEAN == LEAN_TAIL == CRITERIA["qada_tail+E/lean"] == CONFIGS["qada_tail+E/lean fused"]["criterion"] == {
        "name": "qada_tail", "tau": 0.3, "attend_exact": True, **READ_LEAN}
    assert BYTE_CONFIGS["qada_tail+E/lean fused"][0] == LEAN


def test_launch_bytes_spread_row_is_the_gpu_suites():
    """``benchmarks/launch_bytes.py`` spells the GPU suite's ``qada_tail fused spread`` row out (no torch import at
    its top): the same criterion and executor settings."""
    from benchmarks.launch_bytes import CONFIGS as BYTE_CONFIGS
    from benchmarks.suites import FUSED_VARIANTS, SPREAD_PAGES

    criterion, moments, executor = BYTE_CONFIGS["qada_tail fused spread"]
    base, settings = FUSED_VARIANTS["qada_tail fused spread"]
    assert criterion["name"] == base and moments == "stored"
    assert executor == settings and executor["pages_per_program"] == SPREAD_PAGES


def test_parity_section_rows_and_a_failed_case(monkeypatch):
    """``benchmarks/parity.py`` on the CPU (the device is the CPU again, the Triton executor in the interpreter):
    the CPU's decisions against themselves are equal, with counts that are not vacuous; a case whose executor fails
    is a row with its error, and the cases after it still run."""
    pytest.importorskip("triton", reason="triton is not installed")  # (the interpreter: tests/conftest.py)
    from benchmarks import parity

    monkeypatch.setitem(parity.EXECUTORS, "broken", {"name": "no_such_executor"})
    cases = parity.ParityCases(length=200, tokens=2, layers=1, criteria=(("qada", 0.6),), moments=("current",),
                               executors=("broken", "triton_fused"))  # fmt: skip
    seen = []
    rows = parity.run_parity(cases, torch.device("cpu"), lambda *a, **k: None, on_row=seen.append)
    assert seen == rows and [r["executor"] for r in rows] == ["broken", "triton_fused"]
    assert "no_such_executor" in rows[0]["error"] and "decisions" not in rows[0]
    done = rows[1]
    assert done["equal"] and done["decisions"] == 2 * 9 and done["unexplained"] == done["missing"] == 0
    assert done["sparsity_cpu"] == done["sparsity_device"] and done["reference_device"] is None  # (current moments)
    assert not parity.applies("qada_tail", "triton_fused estimating") and parity.applies("qada", "triton_fused")
    # a configuration whose CPU reference fails: its cases are rows with that error, the next configuration runs
    cases = parity.ParityCases(length=200, tokens=1, layers=1, criteria=(("no_such_criterion", 0.5), ("qada", 0.6)),
                               moments=("current",), executors=("triton_fused",))  # fmt: skip
    rows = parity.run_parity(cases, torch.device("cpu"), lambda *a, **k: None)
    assert "reference decisions" in rows[0]["error"] and "no_such_criterion" in rows[0]["error"] and rows[1]["equal"]
