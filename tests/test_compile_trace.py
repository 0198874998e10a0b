"""The ``triton_fused`` layer step as ``torch.compile`` traces it for a CUDA GPU, checked on the CPU
(``benchmarks/compile_trace.py``): one graph, the expected launches and nothing else, no launch the write analysis
cannot read, and no tensor copied before a launch once Inductor has re-inplaced (a copy is a kernel per layer; a
launch taken as writing its inputs would copy the query, the moments or the KV cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.triton_launches import fused_step_launches

pytest.importorskip("triton", reason="triton is not installed")

ROOT = Path(__file__).resolve().parent.parent

CASES = {  # name: (model family, moment source, criterion, executor)
    "qada": ("llama", "stored", {"name": "qada", "tau": 0.3}, {}),
    "qada decide_once": ("llama", "stored", {"name": "qada", "tau": 0.3}, {"decide_once": True}),
    "qada_tail current": ("llama", "current", {"name": "qada_tail", "tau": 0.3}, {}),
    "qada_tail pages spread": ("llama", "stored", {"name": "qada_tail", "tau": 0.3},
                               {"decide_once": True, "pages_per_program": 1}),
    "qada_tail_budget": ("llama", "stored", {"name": "qada_tail_budget", "sparsity": 0.5}, {}),
    "qada_tail_budget per group current": ("llama", "current",
                                           {"name": "qada_tail_budget", "sparsity": 0.5, "per_group": True}, {}),
    "qada soft cap (gemma2)": ("gemma2", "current", {"name": "qada", "tau": 0.3}, {}),
    "qada_tail sinks (gpt_oss)": ("gpt_oss", "current", {"name": "qada_tail", "tau": 0.3}, {}),
    "qada estimating": ("llama", "stored", {"name": "qada", "tau": 0.3}, {"estimate_in_splits": True}),
    "qada estimating soft cap (gemma2)": ("gemma2", "current", {"name": "qada", "tau": 0.3},
                                          {"estimate_in_splits": True}),
}  # fmt: skip

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch
    from benchmarks.compile_trace import capture_layer_step, pretend_cuda_triton, trace_decode_forward, trace_layer_step
    pretend_cuda_triton()
    from family_matrix import tiny_family_model
    from tiny_models import tiny_model
    from qada.models import build_run
    from qada.moments import StoredMoments
    from qada.moments.reference import collect_reference_keys

    cases = json.loads({cases!r})
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    longer = torch.randint(3, 128, (1, 57), generator=torch.Generator().manual_seed(6))
    rows, models, references = {{}}, {{}}, {{}}
    for name, (family, source, criterion, executor) in cases.items():
        if family not in models:
            models[family] = tiny_model("llama") if family == "llama" else tiny_family_model(family)
        model = models[family]
        if source == "stored":
            if family not in references:
                references[family] = collect_reference_keys(model, ids, chunk_size=16)
            source = StoredMoments(offset=12, min_bulk_keys=4)
            source.set_reference(references[family])
        run = build_run(criterion=criterion, moments=source, executor={{"name": "triton_fused", "block_size": 16,
                        **executor}}, window={{"t_local": 8, "t_sink": 2}})
        step, first = capture_layer_step(model, run, ids)
        _, second = capture_layer_step(model, run, longer)  # a second cache size: symbolic sizes
        rows[name] = trace_layer_step(step, first, second)
        if name in {forward!r}:  # the model's decode step around it
            rows[name]["forward"] = trace_decode_forward(model, run, ids)
            if family + " dense" not in rows:
                rows[family + " dense"] = {{"forward": trace_decode_forward(model, None, ids)}}
    print("ROWS" + json.dumps(rows))
    """
)

FORWARD = ["qada", "qada_tail current", "qada soft cap (gemma2)"]  # cases whose whole decode step is traced too

READ_ONLY = {"Q", "K", "V", "MEAN", "COV", "START", "END", "SINKS", "GH_X", "GH_LOGW", "HEAVY", "HEAVY_VALID", "MEMBER"}


@pytest.fixture(scope="module")
def traced():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend (the write analysis compiles for sm_90)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"), cases=json.dumps(CASES), forward=FORWARD)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("ROWS", 1)[1])


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_fused_step_is_its_launches_and_nothing_else(traced, case):
    """Traced in one graph per cache size (static shapes, then symbolic ones); exactly the expected launches; no
    other operation than views and allocations, no dtype view, no tensor made from host data; every launch
    readable by the write analysis; nothing copied before a launch after re-inplacing; no launch writes an input of
    the step (query, keys, values, moments, row bounds, the tail index's read-only parts)."""
    _, source, criterion, executor = CASES[case]
    row = traced[case]
    assert row["error"] is None, row["error"]
    assert row["analysis_fallbacks"] == []
    assert len(row["graphs"]) == 2  # static shapes, then symbolic ones
    for graph in row["graphs"]:
        expected = fused_step_launches(source, criterion["name"], executor.get("decide_once", False),
                                       executor.get("estimate_in_splits", False))
        assert [launch["kernel"] for launch in graph["launches"]] == expected
        assert graph["ops"] == {} and graph["constants"] == 0
        assert graph["dtype_views"] == []  # (a bool one fails Inductor's lowering on torch 2.11, a GPU's torch)
        for launch in graph["launches"]:
            assert launch["copies"] == [], launch
            assert launch["writes"], launch
            if not launch["kernel"].endswith("moment_step_kernel"):  # (its MEAN, COV are its outputs)
                assert not set(launch["writes"]) & READ_ONLY, launch


@pytest.mark.parametrize("case", ["qada estimating", "qada estimating soft cap (gemma2)"])
def test_the_combine_that_steps_the_moments_is_seen_writing_them(traced, case):
    """With the moments a step ahead, the write analysis sees the combine launch write the moment state (float64
    sums, count, the float32 moments the next step's splits read) besides the output: a compiled step that did not
    know would be free to drop or reorder those writes. (The tiny models' heads are one block pair: no arrival
    count to write.)"""
    _, source, _, _ = CASES[case]
    state = {"MS_COUNT"} | ({"MS_S1", "MS_S2", "MS_MEAN", "MS_COV"} if source == "stored"
                            else {"MS_MEAN", "MS_M2", "MS_OUT_MEAN", "MS_OUT_COV"})
    for graph in traced[case]["graphs"]:
        combine = graph["launches"][-1]
        assert combine["kernel"] == f"combine_and_{source}_step_kernel"
        assert state <= set(combine["writes"]) and "OUT" in combine["writes"], sorted(state - set(combine["writes"]))


@pytest.mark.parametrize("case", FORWARD)
def test_the_compiled_model_step_holds_one_qada_operation_per_layer_and_nothing_else(traced, case):
    """``torch.compile(model.forward)`` of a decode step: each global layer's qada step is one opaque
    ``qada.decode_buffer`` operation, no Triton launch is traced into the model's graph, and qada adds nothing else
    to it: every other operation is one the dense model's step has too, at most as often (the dense attention and
    its mask operations are gone). That last part is checked on the plain model only: a soft-capped model's sliding
    layers run qada's masked attention in place of the model's own, whose operations differ between transformers
    versions."""
    family = CASES[case][0]
    dense, qada = traced[family + " dense"]["forward"], traced[case]["forward"]
    assert qada["qada_steps"] == {"llama": 2, "gemma2": 1}[family]  # gemma2's tiny model: 1 global, 1 sliding layer
    assert qada["launches"] == 0 and dense["qada_steps"] == 0
    if family != "llama":
        return
    others = {name: n for name, n in qada["ops"].items() if name != "qada.decode_buffer"}
    assert all(n <= dense["ops"].get(name, 0) for name, n in others.items()), (others, dense["ops"])
    assert sum(others.values()) < dense["total"]


def test_fused_host_time_benchmark_times_every_configuration(tmp_path):
    """``benchmarks/fused_host_time.py`` (its own process: it replaces Triton's launch) times each fused
    configuration's eager layer step and names the launches it would make."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_host_time.py"), "--length", "96",
                           "--calls", "2", "--repeats", "1", "--out", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "fused-host-time-cpu.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["qada", "qada, decide_once", "qada_tail", "qada_tail_budget"]
    assert all(r["seconds_per_call"] > 0 and r["launches"][-1] == "qada_decode_combine_kernel" for r in rows)
    assert rows[0]["launches"] == ["stored_moment_step_kernel", "qada_fused_split_kernel",
                                   "qada_decode_combine_kernel"]
