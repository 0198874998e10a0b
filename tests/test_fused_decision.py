"""The fused decision of a buffer decode step (``qada`` with ``compile=True`` on a ``StaticCache``): the moment step,
the window gather, eqs. 5-7, the threshold, the group policy and the sparsities as one compiled function
(:class:`qada.models.fused.FusedDecision`) give the same tokens, logits, statistics and moment state as the
eager path, with left padding and a stored range that jumps during decoding; no host read inside the step."""

from __future__ import annotations

import pytest
import torch
from test_buffer_decode import STEPS, greedy, make_run, no_host_reads_in_decode_steps
from test_buffer_decode import model as model  # noqa: F401  (fixture)
from test_buffer_decode import reference as reference  # noqa: F401  (fixture)

from qada.models.fused import FusedDecision, fused_layer_decision

SOURCES = ["stored", "current", {"name": "current", "freeze": True}]


def fused_run(source, executor, reference, tau=0.3, compile=True):
    return make_run({"name": "qada", "tau": tau, "compile": compile}, source, executor, reference)


@pytest.mark.parametrize("executor", [{"name": "sdpa", "host_skip": False}, "sdpa", "reference"],
                         ids=["sdpa-no-host-skip", "sdpa", "reference"])
@pytest.mark.parametrize("source", SOURCES, ids=["stored", "current", "current-frozen"])
def test_the_fused_decision_equals_the_eager_one(model, reference, source, executor):
    eager = greedy(model, fused_run(source, executor, reference, compile=False), "static")
    run = fused_run(source, executor, reference)
    calls = []
    original = FusedDecision.__call__

    def spy(self, *args, **kwargs):
        decision = original(self, *args, **kwargs)
        calls.append(decision is not None)
        return decision

    FusedDecision.__call__ = spy
    try:
        fused = greedy(model, run, "static")
    finally:
        FusedDecision.__call__ = original
    assert calls == [True] * (STEPS * model.config.num_hidden_layers)  # every step of every layer was fused
    assert torch.equal(eager[0], fused[0])
    torch.testing.assert_close(fused[1], eager[1], atol=1e-5, rtol=1e-5)
    for key in ("sparsity", "kv_sparsity", "kv_read"):
        assert fused[2][key] == pytest.approx(eager[2][key], abs=1e-9)
    assert fused[2]["decode_steps"] == eager[2]["decode_steps"] == STEPS
    assert fused[2]["fail_safe"] == eager[2]["fail_safe"]
    assert fused[2]["sparsity_per_layer"] == pytest.approx(eager[2]["sparsity_per_layer"], abs=1e-9)


def test_the_fused_runs_decide_both_ways(model, reference):
    """The equality above is not vacuous: some heads local, some dense, with both kinds of moments."""
    for source in ("stored", "current"):
        summary = greedy(model, fused_run(source, "sdpa", reference), "static")[2]
        assert 0.1 < summary["sparsity"] < 0.95 and 0.0 < summary["kv_sparsity"] < 1.0, source


@pytest.mark.parametrize("source", ["stored", "current"])
def test_the_fused_step_leaves_the_moment_state_of_the_eager_one(model, reference, source):
    """After decoding (the stored range of row 1 jumps at 18 real tokens), the state tensors agree."""
    runs = [fused_run(source, "sdpa", reference, compile=flag) for flag in (False, True)]
    for run in runs:
        greedy(model, run, "static")
    layers = model.config.num_hidden_layers
    for layer in range(layers):
        eager, fused = (run.moments.fused_state(layer, torch.device("cpu")) for run in runs)
        for a, b in zip(eager, fused, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_the_fused_decode_step_never_reads_the_host(model, reference):
    """Once compiled (the compiler itself makes tensors from Python data), a fused step reads nothing back."""
    run = fused_run("stored", {"name": "sdpa", "host_skip": False}, reference)
    greedy(model, run, "static", steps=3)
    with no_host_reads_in_decode_steps(), torch._dynamo.config.patch(error_on_recompile=True):
        greedy(model, run, "static", steps=3)  # the same shapes: every layer and step reuses the compiled code


def test_without_compile_or_with_another_criterion_there_is_no_fused_decision(reference):
    assert FusedDecision.for_run(fused_run("stored", "sdpa", reference, compile=False)) is None
    assert FusedDecision.for_run(make_run({"name": "oracle", "tau": 0.3}, "none", "sdpa", reference)) is None
    assert FusedDecision.for_run(make_run({"name": "qada_budget", "sparsity": 0.5}, "stored", "sdpa",
                                          reference)) is None
    assert FusedDecision.for_run(fused_run("bucketed", "sdpa", reference)) is None  # no fused step: eager
    assert FusedDecision.for_run(fused_run("stored", "sdpa", reference)) is not None


def test_the_uncompiled_function_equals_the_step_objects():
    """:func:`fused_layer_decision` run eagerly on random tensors: the decision of ``QAdACriterion`` on a
    ``DecodeStep`` with the same moments, and the effective mask of the executor's group policy."""
    from qada.attention.group_policy import apply_group_policy, kv_read
    from qada.criteria import QAdACriterion
    from qada.functional.fused import qada_threshold_decision
    from qada.step import BulkMoments, DecodeStep
    from qada.window import Window

    torch.manual_seed(0)
    b, H, H_kv, C, d = 3, 6, 2, 40, 8
    keys, values, query = torch.randn(b, H_kv, C, d), torch.randn(b, H_kv, C, d), torch.randn(b, H, d) * 2
    start, end = torch.tensor([0, 3, 10]), torch.tensor([30, 33, 18])
    mean = torch.randn(b, H_kv, d) * 0.1
    cov = torch.eye(d).expand(b, H_kv, d, d) * 0.5
    state = (mean.clone(), cov.clone())

    def step_fn(m, c, keys, start, end):
        return BulkMoments(m, c)

    criterion = QAdACriterion(tau=0.5)
    got = fused_layer_decision(query, keys, values, start, end, 0.3, state, moment_step=step_fn,
                               decide=lambda *a: qada_threshold_decision(*a, log_tau=criterion._log_tau()),
                               t_local=8, t_sink=2, policy="exact")
    step = DecodeStep(query, keys, 0.3, Window(8, 2), start=start, end=end, moments=BulkMoments(mean, cov),
                      values=values)
    expected = criterion(step)
    assert torch.equal(got.decided, expected)
    local, read = apply_group_policy(expected, step.has_bulk, H_kv)
    assert torch.equal(got.local, local) and torch.equal(got.read, read)
    assert torch.equal(got.window_keys, step.window_keys) and torch.equal(got.window_values, step.window_values)
    assert torch.equal(got.t_bulk, step.t_bulk)
    assert got.counts.tolist() == pytest.approx([local.float().mean().item(), (~read).float().mean().item(), 1.0, 0.0,
                                        kv_read(read, step.t_bulk + 8, 8).item()])
    assert got.decided[2].all() and not got.decided[:2].all()  # row 2 (8 real tokens) has no bulk: all local
