# ruff: noqa: F811 - the fixtures model and reference are imported from test_fused_decision, then requested by name
"""``triton_fused(estimate_in_splits=True)``: each split program computes its heads' ``log E[exp(s)]`` from the
float32 bulk moments instead of reading it from a launch before. The same float32 value as the launch that writes
it, so the same decisions, output and counts bit for bit, in fewer launches. On CPU the kernels run in Triton's
interpreter (small shapes only)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from qada.attention import FusedTritonExecutor  # noqa: E402
from tests.test_fused_decision import CASES, check_fused, eager, fresh, make_step, tau_between  # noqa: E402

FLAGS = ("decided", "local", "read", "broken", "counts", "row", "bulk_blocks")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C{c[3]}-d{c[4]}-{str(c[7])[6:]}-cap{c[8]}-sinks{c[9]}-{c[10]}")
def test_splits_that_estimate_decide_and_attend_as_the_estimate_launch(case):
    """Every case of the fused decision tests (soft cap and sink logits included): the eager decisions and the
    unfused output (:func:`check_fused`), and bit for bit what the splits decide and attend reading the estimate
    launch's ``log E[exp(s)]``."""
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    _, _, _, _, ratio = eager(step, 0.5, policy)
    tau = tau_between(ratio, fresh(step).has_bulk, H // H_kv)
    got, _ = check_fused(step, tau, policy, block, splits, estimate_in_splits=True)
    read = FusedTritonExecutor(group_policy=policy, block_size=block, num_splits=splits).decide_and_attend(
        fresh(step), tau, policy)
    for name in FLAGS:
        assert torch.equal(getattr(got, name), getattr(read, name)), name
    torch.testing.assert_close(got.output, read.output, atol=0, rtol=0)


def test_the_estimate_decides_near_tau_as_the_estimate_launch():
    """At a threshold on a head's own ratio (a decision that hinges on the estimate's last bit) the splits that
    estimate decide as the estimate launch does: the same float32 ``log E[exp(s)]``, not a close one."""
    step = make_step(2, 6, 2, 520, 32, [0, 60], [500, 520], torch.float32, seed=11)
    _, _, _, _, ratio = eager(step, 0.5)
    has_bulk = fresh(step).has_bulk
    for tau in ratio[has_bulk].flatten()[:4].tolist():
        one = FusedTritonExecutor(block_size=32, num_splits=4, estimate_in_splits=True).decide_and_attend(
            fresh(step), tau)
        two = FusedTritonExecutor(block_size=32, num_splits=4).decide_and_attend(fresh(step), tau)
        for name in FLAGS:
            assert torch.equal(getattr(one, name), getattr(two, name)), (tau, name)


def test_only_the_covariance_blocks_on_and_above_the_diagonal_are_read():
    """A covariance is symmetric, so the estimate reads its blocks ``[I, J]``, ``I <= J``, only (an off-diagonal
    one counted twice): NaN in every block below the diagonal changes neither the estimate launch's ``log E[exp(s)]``
    nor what the splits that estimate decide and attend (d = 64: blocks of 32, one pair off the diagonal)."""
    from qada.attention.moment_step import block_sizes, estimate_launch
    from qada.step import BulkMoments

    step = make_step(2, 6, 2, 300, 64, [0, 9], [300, 280], torch.float32, seed=5)
    mean, cov = step.moments
    t = block_sizes(64, 3)["BLOCK_T"]
    below = (torch.arange(64)[:, None] // t) > (torch.arange(64)[None, :] // t)
    assert t == 32 and below.any()
    poisoned = fresh(step)
    poisoned.moments = BulkMoments(mean, cov.masked_fill(below.to(cov.device), float("nan")))
    executor = FusedTritonExecutor(block_size=16, num_splits=3)
    clean = estimate_launch(executor.bulk_estimate(step.query, step.scale, step.softcap), step.moments)
    dirty = estimate_launch(executor.bulk_estimate(step.query, step.scale, step.softcap), poisoned.moments)
    assert clean.isfinite().all() and torch.equal(dirty, clean)
    _, _, _, _, ratio = eager(step, 0.5)
    tau = tau_between(ratio, fresh(step).has_bulk, 3)
    estimating = FusedTritonExecutor(block_size=16, num_splits=3, estimate_in_splits=True)
    got = estimating.decide_and_attend(poisoned, tau)
    expected = estimating.decide_and_attend(fresh(step), tau)
    for name in FLAGS:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    torch.testing.assert_close(got.output, expected.output, atol=0, rtol=0)


def test_two_launches_and_no_host_read(monkeypatch):
    """The step's decision and attention from the moments alone: the split launch and the combine launch (no
    estimate launch before), no host read, only allocations."""
    from tests.triton_launches import ALLOCATIONS_AND_VIEWS, LaunchRecorder, refusing_host_reads

    step = make_step(2, 4, 2, 150, 16, [0, 9], [150, 130], torch.float32, seed=6)
    executor = FusedTritonExecutor(block_size=16, num_splits=3, estimate_in_splits=True)
    record = LaunchRecorder(monkeypatch)
    with refusing_host_reads(monkeypatch), record:
        executor.decide_and_attend(step, 0.3)
    assert record.launches == [("qada_fused_split_kernel", (4, 3)), ("qada_decode_combine_kernel", (2 * 4 + 1,))]
    assert set(record.ops) <= ALLOCATIONS_AND_VIEWS, record.ops


def test_an_estimate_given_to_splits_that_estimate_is_an_error():
    """With ``estimate_in_splits`` the splits compute ``log E[exp(s)]`` themselves: one passed in is refused, not
    ignored; and the option must be a bool."""
    step = make_step(1, 4, 2, 60, 16, None, None, torch.float32, seed=3)
    executor = FusedTritonExecutor(block_size=16, num_splits=2, estimate_in_splits=True)
    given = torch.zeros(1, 4, device=step.query.device)
    with pytest.raises(ValueError, match="estimate_in_splits"):
        executor.decide_and_attend(fresh(step), 0.5, log_mean_exp=given)
    with pytest.raises(ValueError, match="estimate_in_splits"):
        FusedTritonExecutor(estimate_in_splits=1)


def test_only_a_plain_decision_in_the_splits_estimates_there():
    """``decide_once`` (the estimate's launch decides) and a budget or tail-aware decision keep their launches."""
    executor = FusedTritonExecutor(estimate_in_splits=True)
    assert executor.estimates_in_splits()
    assert not FusedTritonExecutor(estimate_in_splits=True, decide_once=True).estimates_in_splits()
    assert not FusedTritonExecutor().estimates_in_splits()
    assert not executor.estimates_in_splits(budget=object())
    assert not executor.estimates_in_splits(tail=object())


# --- in a model -------------------------------------------------------------------------------------------------

from tests.test_fused_decision import greedy, make_run, model, reference  # noqa: E402,F401  (fixtures)

FROZEN = {"name": "current", "freeze": True}


@pytest.mark.parametrize(("source", "cache"), [("stored", "static"), ("current", "static"), ("frozen", "static"),
                                             ("stored", "dynamic"), ("current", "dynamic")])
def test_model_run_estimating_in_splits_equals_the_estimate_launch(model, reference, source, cache):
    """Greedy decoding on the tiny model (two rows, one left-padded): the same tokens and statistics, exactly, with
    the estimate in the splits as with the launch that writes it (the moment step's, or after a frozen source's
    moments one of its own); for ``stored`` and ``current`` with the moments stepped one decode step ahead, by the
    prefill and then each step's combine launch."""
    moments = FROZEN if source == "frozen" else source
    executor = {"name": "triton_fused", "block_size": 16}
    read = greedy(model, make_run(moments, executor, reference), cache)
    estimated = greedy(model, make_run(moments, {**executor, "estimate_in_splits": True}, reference), cache)
    assert torch.equal(estimated[0], read[0])
    for key in ("sparsity", "kv_sparsity", "kv_read", "fail_safe", "decode_steps"):
        assert estimated[1][key] == read[1][key], key
    assert 0.0 < estimated[1]["kv_sparsity"] < 1.0  # not vacuous: some groups skip their bulk, some read it


@pytest.mark.parametrize(("source", "expected"), [
    ("frozen", ["qada_fused_split_kernel", "qada_decode_combine_kernel"]),
    ("stored", ["qada_fused_split_kernel", "combine_and_stored_step_kernel"]),
    ("current", ["qada_fused_split_kernel", "combine_and_current_step_kernel"]),
])
def test_model_layer_step_is_two_launches(monkeypatch, model, reference, source, expected):
    """A layer's decode step estimating in the splits is two launches, as the dense path's: the split and the combine,
    which for the ``stored`` and ``current`` sources also steps the moments for the next decode step."""
    from qada.models.layer_step import LayerStep
    from tests.triton_launches import LaunchRecorder

    record = LaunchRecorder(monkeypatch)
    steps: list = []
    original = LayerStep.__call__

    def recorded(self, buffered, *args):
        before = len(record.launches)
        with record:
            result = original(self, buffered, *args)
        steps.append([name for name, _ in record.launches[before:]])
        return result

    monkeypatch.setattr(LayerStep, "__call__", recorded)
    executor = {"name": "triton_fused", "block_size": 16, "estimate_in_splits": True}
    greedy(model, make_run(FROZEN if source == "frozen" else source, executor, reference), "static", steps=2)
    assert len(steps) == 2 * model.config.num_hidden_layers
    assert all(launches == expected for launches in steps), steps
