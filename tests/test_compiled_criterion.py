"""``QAdACriterion(compile=True)``: the fused decision, eager and compiled, equals the step-by-step path."""

import math

import pytest
import torch

from qada.criteria import QAdACriterion
from qada.functional.fused import qada_threshold_decision
from qada.moments import BulkMoments
from qada.step import DecodeStep
from qada.window import Window


def _step(seed: int, start=None, T=300) -> DecodeStep:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, T, 16, generator=g)
    keys[:, :, :4] += 1.5
    bulk = keys[:, :, 4 : T - 28]
    mean = bulk.mean(2)
    centred = bulk - mean[:, :, None]
    return DecodeStep(torch.randn(3, 8, 16, generator=g) * 1.5, keys, 0.25, Window(32, 4), start=start,
                      moments=BulkMoments(mean, centred.transpose(-1, -2) @ centred / bulk.shape[2]))


@pytest.mark.parametrize("start", [None, torch.tensor([0, 40, 280])])  # the last row has no bulk
@pytest.mark.parametrize("tau", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_fused_eager_equals_the_step_path_bit_for_bit(start, tau):
    for seed in range(5):
        step = _step(seed, start)
        mean, cov = step.bulk_moments
        log_tau = math.log(tau) if tau > 0 else float("-inf")
        valid = None if start is None else step.window_valid
        local, broken = qada_threshold_decision(step.query, step.window_keys, valid, mean, cov, step.t_bulk,
                                                step.scale, log_tau)
        reference = _step(seed, start)
        assert torch.equal(local, QAdACriterion(tau=tau)(reference))
        assert not broken.any()


def test_compiled_criterion_matches_eager_away_from_tau():
    criterion, eager = QAdACriterion(tau=0.6, compile=True), QAdACriterion(tau=0.6)
    for seed in range(4):
        for start in (None, torch.tensor([0, 40, 280])):
            step, reference = _step(seed, start), _step(seed, start)
            got, want = criterion(step), eager(reference)
            ratio = reference.log_local - torch.logaddexp(reference.log_local, reference.log_bulk_estimate)
            near = (ratio - math.log(0.6)).abs() < 1e-4
            assert torch.equal(got | near, want | near)
            assert int(step.fail_safe) == 0
    assert criterion.to_config() == {"name": "qada", "tau": 0.6, "compile": True}


def test_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="expected compile to be a bool"):
        QAdACriterion(compile="yes")
