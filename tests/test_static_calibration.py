import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qada.criteria import StaticCalibrator, StaticCriterion
from qada.functional import calibrate_static_mask, static_local_count


@given(
    L=st.integers(1, 6),
    H=st.integers(1, 6),
    alpha=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_calibration_picks_exactly_the_most_local_heads(L, H, alpha, data):
    levels = data.draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), min_size=L * H, max_size=L * H))
    frequency = torch.tensor(levels).view(L, H)
    mask = calibrate_static_mask(frequency, alpha)
    expected_count = int(alpha * L * H + 0.5)  # round half up
    assert mask.sum().item() == expected_count == static_local_count(alpha, L, H)
    # reference ranking: sort (layer, head) by descending frequency, ties by (layer, head)
    ranked = sorted((-frequency[l, h].item(), l, h) for l in range(L) for h in range(H))
    expected = torch.zeros(L, H, dtype=torch.bool)
    for _, l, h in ranked[:expected_count]:
        expected[l, h] = True
    assert torch.equal(mask, expected)


def test_ties_broken_by_layer_then_head():
    frequency = torch.tensor([[0.5, 0.9], [0.5, 0.5]])
    mask = calibrate_static_mask(frequency, 0.5)  # 2 heads: (0,1) first, then the earliest tie (0,0)
    assert mask.tolist() == [[True, True], [False, False]]


def test_rounding_half_up():
    assert static_local_count(0.5, 1, 5) == 3
    assert static_local_count(0.05, 30, 9) == 14  # 13.5 -> 14


def test_bad_alpha_and_frequency():
    with pytest.raises(ValueError, match=r"expected alpha in \[0, 1\]"):
        calibrate_static_mask(torch.zeros(2, 2), 1.2)
    with pytest.raises(ValueError, match="finite"):
        calibrate_static_mask(torch.tensor([[float("nan")]]), 0.5)


def test_calibrator_accumulates_merges_and_builds_the_static_criterion():
    a = StaticCalibrator(2, 3, tau_static=0.6)
    b = StaticCalibrator(2, 3, tau_static=0.6)
    a.update(0, torch.tensor([[True, False, True]]))
    a.update(1, torch.tensor([[False, False, True], [False, True, True]]))
    b.update(0, torch.tensor([[True, False, False]]))
    b.update(1, torch.tensor([[False, False, True]]))
    a.merge(b)
    frequency = a.compute()
    torch.testing.assert_close(frequency, torch.tensor([[1.0, 0.0, 0.5], [0.0, 1 / 3, 1.0]]))
    criterion = a.static_criterion(0.5)
    assert isinstance(criterion, StaticCriterion)
    assert criterion.mask.tolist() == [[True, False, True], [False, False, True]]
    assert a.criterion().tau == 0.6
    a.reset()
    with pytest.raises(RuntimeError, match="no decode steps recorded"):
        a.compute()
    with pytest.raises(ValueError, match="same num_layers"):
        a.merge(StaticCalibrator(3, 3))
