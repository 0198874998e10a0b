"""The decode step object and the middle criterion bases (issue 13)."""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qada.step
from qada.attention import EXECUTORS, decode_attention
from qada.criteria import (
    CRITERIA,
    BudgetCriterion,
    QAdACriterion,
    StaticCriterion,
    ThresholdCriterion,
    top_k_mask,
)
from qada.models import CacheGuard, DecodeStatistics, ObserverFanout, StaleStateError
from qada.moments import BulkMoments
from qada.step import DecodeStep
from qada.window import Window


def _step(b=2, H=6, H_kv=3, T=200, d=8, seed=0, start=None, values=True) -> DecodeStep:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, H_kv, T, d, generator=g)
    return DecodeStep(
        torch.randn(b, H, d, generator=g), keys, d**-0.5, Window(32, 4), start=start,
        moments=BulkMoments(keys.mean(2), torch.eye(d).expand(b, H_kv, d, d)),
        values=torch.randn(b, H_kv, T, d, generator=g) if values else None,
    )  # fmt: skip


@dataclass
class FixedLogBulk(ThresholdCriterion):
    value: object = None

    def log_bulk(self, step):
        return self.value


@dataclass
class FixedScore(BudgetCriterion):
    value: object = None

    def score(self, step):
        return self.value


# --- the step -------------------------------------------------------------------------------------------------
def test_the_window_is_gathered_once_per_step_for_criterion_and_executor(monkeypatch):
    calls = []
    original = qada.step.gather_window

    def counting(x, *args, **kwargs):
        calls.append(x)
        return original(x, *args, **kwargs)

    monkeypatch.setattr(qada.step, "gather_window", counting)
    step = _step(start=torch.tensor([0, 50]))
    local = QAdACriterion(tau=0.5)(step)
    assert len(calls) == 1 and calls[0] is step.keys
    EXECUTORS.build("sdpa")(step, local | torch.tensor([[True] * 6, [False] * 6]))
    assert len(calls) == 2 and calls[1] is step.values  # the values' window, the keys' one reused
    assert step.has_bulk is step.has_bulk  # cached, not recomputed


def test_step_checks_its_inputs():
    with pytest.raises(ValueError, match="expected scale"):
        DecodeStep(torch.zeros(1, 2, 4), torch.zeros(1, 1, 9, 4), scale=float("nan"))
    with pytest.raises(ValueError, match="values of shape"):
        DecodeStep(torch.zeros(1, 2, 4), torch.zeros(1, 1, 9, 4), 0.5, values=torch.zeros(1, 1, 8, 4))
    with pytest.raises(TypeError, match="qada.Window"):
        DecodeStep(torch.zeros(1, 2, 4), torch.zeros(1, 1, 9, 4), 0.5, window=(4, 1))
    with pytest.raises(ValueError, match="integer tensor"):
        DecodeStep(torch.zeros(1, 2, 4), torch.zeros(1, 1, 9, 4), 0.5, start=torch.zeros(1))
    with pytest.raises(ValueError, match="with values"):
        EXECUTORS.build("sdpa")(_step(values=False), torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="expected local to be a bool tensor"):
        EXECUTORS.build("sdpa")(_step(), torch.zeros(2, 6))


def test_executor_on_a_step_equals_decode_attention_on_tensors():
    step = _step(start=torch.tensor([3, 0]))
    local = torch.tensor([[True, False, True, True, True, True], [False] * 6])
    by_step = EXECUTORS.build("reference")(step, local)
    by_tensors = decode_attention(EXECUTORS.build("reference"), step.query[:, :, None], step.keys, step.values,
                                  local, step.window, step.scale, step.start)
    torch.testing.assert_close(by_step.output, by_tensors.output, rtol=0, atol=0)


# --- ThresholdCriterion ---------------------------------------------------------------------------------------
def test_threshold_base_applies_tau_fail_safe_and_no_bulk():
    step = _step(b=2, start=torch.tensor([0, 170]))  # row 1 has 30 real tokens: no bulk
    value = step.log_local.clone()  # ratio 1/2 everywhere
    value[0, 0] = float("nan")
    value[0, 1] = float("inf")
    value[1, 0] = float("nan")  # no bulk: local anyway, not counted
    local = FixedLogBulk(tau=0.49, value=value)(step)
    assert local[0, 2:].all() and not local[0, :2].any()
    assert local[1].all()
    assert int(step.fail_safe) == 2
    assert not FixedLogBulk(tau=0.51, value=step.log_local.clone())(_step(b=2))[0].any()


def test_threshold_base_checks_what_a_subclass_returns():
    step = _step()
    with pytest.raises(ValueError, match=r"log_bulk of shape \[2, 6\]"):
        FixedLogBulk(value=torch.zeros(2, 3))(step)
    with pytest.raises(ValueError, match="floating tensor"):
        FixedLogBulk(value=torch.zeros(2, 6, dtype=torch.long))(step)
    with pytest.raises(ValueError, match=r"expected tau in \[0, 1\]"):
        FixedLogBulk(tau=1.2)


# --- BudgetCriterion ------------------------------------------------------------------------------------------
@given(st.integers(1, 4), st.integers(1, 12), st.floats(0, 1), st.integers(0, 2**31 - 1))
def test_budget_keeps_round_sparsity_h_heads_of_each_row(b, H, sparsity, seed):
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(0, 3, (b, H), generator=g).float()  # many ties
    step = DecodeStep(torch.zeros(b, H, 4), torch.zeros(b, 1, 10, 4), 0.5)
    local = FixedScore(sparsity=sparsity, value=score)(step)
    k = int(sparsity * H + 0.5)
    assert (local.sum(-1) == k).all()
    # every local head scores at least as high as every dense head of its row
    low = torch.where(local, score, torch.inf).amin(-1)
    high = torch.where(local, -torch.inf, score).amax(-1)
    assert (low >= high).all()
    assert torch.equal(local, top_k_mask(score, k))


def test_top_k_ties_go_to_the_lower_head_index():
    assert top_k_mask(torch.tensor([[1.0, 2.0, 2.0, 2.0]]), 2).tolist() == [[False, True, True, False]]


def test_budget_never_makes_a_non_finite_score_local():
    step = _step(b=1, H=6, H_kv=3)
    score = torch.tensor([[float("nan"), 5.0, float("inf"), 1.0, 0.0, -1.0]])
    local = FixedScore(sparsity=0.5, value=score)(step)
    assert local.tolist() == [[False, True, False, True, True, False]]  # the 3 best finite heads
    assert int(step.fail_safe) == 2
    with pytest.raises(ValueError, match=r"expected sparsity in \[0, 1\]"):
        FixedScore(sparsity=-0.1)


def test_static_is_a_budget_with_its_mask_as_the_per_layer_budget():
    mask = torch.tensor([[True, False, True, False, False, False], [False] * 6, [True] * 6])
    criterion = StaticCriterion(mask)
    assert isinstance(criterion, BudgetCriterion)
    assert criterion.to_config() == {"name": "static", "mask": mask.tolist()}
    for layer in range(3):
        step = DecodeStep(torch.randn(2, 6, 8), torch.randn(2, 3, 200, 8), 0.3, layer=layer)
        assert torch.equal(criterion(step), mask[layer].expand(2, 6))
    assert CRITERIA.build("static", mask=mask.tolist()).sparsity == pytest.approx(8 / 18)
    with pytest.raises(ValueError, match="unknown parameter"):
        CRITERIA.build("static", mask=mask.tolist(), sparsity=0.5)


def test_criteria_declare_their_needs():
    assert CRITERIA.build("qada").needs() == {"moments": True, "full_scores": False, "calibration": False}
    assert CRITERIA.build("oracle").needs()["full_scores"]
    assert CRITERIA.build({"name": "static", "mask": [[True]]}).needs()["calibration"]
    composed = CRITERIA.build({"name": "any_of", "criteria": ["qada", {"name": "static", "mask": [[True]]}]})
    assert composed.needs() == {"moments": True, "full_scores": False, "calibration": True}


# --- the parts of a run ---------------------------------------------------------------------------------------
def test_decode_statistics_update_compute_merge_reset():
    a, b = DecodeStatistics(), DecodeStatistics()
    a.update(0, torch.tensor(0.5), torch.tensor(0.25), torch.tensor(1))
    a.update(1, torch.tensor(1.0), torch.tensor(1.0))
    b.update(0, torch.tensor(0.0), torch.tensor(0.0), torch.tensor(2))
    assert a.compute()["sparsity"] == pytest.approx(0.75)
    a.merge(b)
    summary = a.compute()
    assert summary["sparsity"] == pytest.approx(0.5) and summary["sparsity_per_layer"] == {0: 0.25, 1: 1.0}
    assert summary["fail_safe"] == 3 and summary["decode_steps"] == 2
    assert isinstance(a.sums, torch.Tensor) and a.sums.shape == (2, 5)  # sums stay on the device until compute
    a.reset()
    assert a.compute()["decode_steps"] == 0


def test_cache_guard_refuses_what_it_cannot_follow():
    guard = CacheGuard(track_row_order=True)
    with pytest.raises(StaleStateError, match="without a prefill"):
        guard.decode(0, torch.zeros(2, 1, 5, 4))
    keys = torch.randn(2, 1, 5, 4)
    guard.prefill(0, keys)
    assert guard.decode(0, torch.cat([keys, torch.randn(2, 1, 1, 4)], 2)) == 0
    with pytest.raises(StaleStateError, match="cache went from 6 to 8"):
        guard.decode(0, torch.randn(2, 1, 8, 4))
    guard.prefill(0, keys)
    swapped = torch.cat([keys.flip(0), torch.randn(2, 1, 1, 4)], 2)
    with pytest.raises(StaleStateError, match="reordered"):
        guard.decode(0, swapped)


def test_observer_fanout_builds_nothing_without_observers():
    fanout = ObserverFanout()
    assert not fanout and not fanout.wants_oracle
    fanout.decision(None, None, None)  # no observer: returns before touching the step
