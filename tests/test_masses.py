import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qada.functional import full_scores, local_index_set, local_ratio, log_bulk_mass, log_local_mass
from qada.functional.decisions import finite_threshold_decision


def _repeat_kv(x, groups):
    return x.repeat_interleave(groups, dim=1)


def test_masses_match_direct_sums():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 2, 300, 8)
    scores = full_scores(q, k, 0.5)
    local = torch.zeros(1, 300, dtype=torch.bool)
    local[0, local_index_set(300, 128, 16)] = True
    direct = torch.einsum("bhd,bhtd->bht", q.double(), k.double()) * 0.5
    torch.testing.assert_close(log_local_mass(scores, local), direct[..., local[0]].exp().sum(-1).log().float())
    torch.testing.assert_close(log_bulk_mass(scores, ~local), direct[..., ~local[0]].exp().sum(-1).log().float())


def test_empty_sets_give_minus_inf_and_ratio_one():
    scores = torch.randn(1, 3, 10)
    empty = torch.zeros(1, 10, dtype=torch.bool)
    assert torch.isneginf(log_bulk_mass(scores, empty)).all()
    ratio = local_ratio(log_local_mass(scores, ~empty), log_bulk_mass(scores, empty))
    assert torch.equal(ratio, torch.ones(1, 3))


@given(groups=st.sampled_from([1, 2, 3, 4]), kv_heads=st.integers(1, 3), T=st.integers(1, 40), seed=st.integers(0, 99))
def test_gqa_scores_equal_explicit_repeat(groups, kv_heads, T, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, groups * kv_heads, 8, generator=g)
    k = torch.randn(2, kv_heads, T, 8, generator=g)
    explicit = torch.einsum("bhd,bhtd->bht", q, _repeat_kv(k, groups)) * 0.3
    torch.testing.assert_close(full_scores(q, k, 0.3), explicit)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_inputs_accumulate_in_float32(dtype):
    q = torch.full((1, 1, 64), 1.0, dtype=dtype)
    k = torch.full((1, 1, 4, 64), 1.0, dtype=dtype)
    scores = full_scores(q, k, 1.0)
    assert scores.dtype == torch.float32
    assert torch.allclose(scores, torch.full_like(scores, 64.0))


def test_decision_fail_safe_and_trivial_local():
    log_local = torch.tensor([[0.0, 0.0, float("nan"), 0.0]])
    log_bulk = torch.tensor([[-5.0, float("nan"), 0.0, float("inf")]])
    local, broken = finite_threshold_decision(log_local, log_bulk, 0.6, torch.tensor([True]))
    assert local.tolist() == [[True, False, False, False]]
    assert broken.tolist() == [[False, True, True, True]]
    # a row without bulk is local whatever its estimate says
    local, broken = finite_threshold_decision(log_local, log_bulk, 0.6, torch.tensor([False]))
    assert local.all() and not broken.any()


@pytest.mark.parametrize("tau", [-0.1, 1.5, math.nan, "0.5", True])
def test_bad_tau_is_rejected(tau):
    with pytest.raises(ValueError, match=r"expected tau in \[0, 1\]"):
        finite_threshold_decision(torch.zeros(1, 1), torch.zeros(1, 1), tau, torch.tensor([True]))


def test_shape_errors_name_the_expected_layout():
    with pytest.raises(ValueError, match=r"expected query of shape \[batch, heads, head_dim\]"):
        full_scores(torch.randn(2, 8), torch.randn(1, 1, 4, 8), 1.0)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        full_scores(torch.randn(1, 3, 8), torch.randn(1, 2, 4, 8), 1.0)
    with pytest.raises(TypeError, match="floating dtype"):
        full_scores(torch.ones(1, 1, 8, dtype=torch.long), torch.randn(1, 1, 4, 8), 1.0)
