"""Streaming current-prompt moments and the pure moment math."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qada.functional import bulk_mask
from qada.moments import MOMENT_SOURCES, CurrentMoments
from qada.moments.math import (
    add_key,
    block_moments,
    empty_state,
    merge_moments,
    shifted_sums,
    state_from_shifted_sums,
    to_bulk_moments,
)
from qada.window import Window


def reference_moments(keys: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[H, d]`` and population covariance ``[H, d, d]`` of ``keys[0, :, lo:hi]`` (float64)."""
    x = keys[0, :, lo:hi].double()
    if x.shape[1] == 0:
        H, d = keys.shape[1], keys.shape[3]
        return torch.zeros(H, d, dtype=torch.float64), torch.zeros(H, d, d, dtype=torch.float64)
    mean = x.mean(1)
    c = x - mean[:, None]
    return mean, c.transpose(1, 2) @ c / x.shape[1]


# --- pure math ------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    n_a=st.integers(0, 12),
    n_b=st.integers(0, 12),
    d=st.integers(1, 5),
    offset=st.sampled_from([0.0, 100.0, -1e3]),
    seed=st.integers(0, 2**16),
)
def test_chan_merge_equals_moments_of_concatenation(n_a, n_b, d, offset, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(3, n_a, d, generator=g) + offset
    b = torch.randn(3, n_b, d, generator=g) * 2 + offset
    merged = merge_moments(block_moments(a), block_moments(b))
    whole = block_moments(torch.cat([a, b], 1))
    torch.testing.assert_close(merged.count, whole.count)
    torch.testing.assert_close(merged.mean, whole.mean, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(merged.m2, whole.m2, atol=1e-7, rtol=1e-9)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 20), d=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_rank_one_updates_equal_block_moments(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, n, d, generator=g) * 3 + 50
    state = empty_state((2,), d)
    for i in range(n):
        state = add_key(state, keys[:, i])
    whole = block_moments(keys)
    torch.testing.assert_close(state.mean, whole.mean, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(state.m2, whole.m2, atol=1e-7, rtol=1e-9)


def test_add_key_weight_zero_is_identity_and_masked_block():
    keys = torch.randn(2, 6, 3)
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    state = block_moments(keys, mask)
    assert state.count.tolist() == [3.0, 0.0]
    torch.testing.assert_close(state.mean[0], keys[0, [0, 1, 3]].double().mean(0))
    assert torch.all(state.mean[1] == 0) and torch.all(state.m2[1] == 0)
    same = add_key(state, torch.randn(2, 3), torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(same.m2, state.m2)
    mean, cov = to_bulk_moments(state)
    assert mean.dtype == torch.float32 and torch.all(cov[1] == 0)


def test_shifted_sums_round_trip():
    keys = torch.randn(2, 40, 4, dtype=torch.float64) + 100
    shift = keys.mean(1)
    n, s1, s2 = shifted_sums(keys, shift)
    state = state_from_shifted_sums(n, s1, s2, shift)
    whole = block_moments(keys)
    torch.testing.assert_close(state.mean, whole.mean)
    torch.testing.assert_close(state.m2, whole.m2)


# --- the streaming source -------------------------------------------------------------------------------


def test_registered_and_validated():
    assert isinstance(MOMENT_SOURCES.build("current"), CurrentMoments)
    assert MOMENT_SOURCES.build({"name": "current", "freeze": True}).freeze is True
    with pytest.raises(ValueError, match="expected freeze"):
        CurrentMoments(freeze=1)


def test_prefill_matches_bulk_definition():
    window = Window(8, 2)
    keys = torch.randn(1, 2, 30, 4)
    source = CurrentMoments()
    source.prefill(0, keys, None, window)
    mean, cov = source.moments(0, keys, None, window)
    ref_mean, ref_cov = reference_moments(keys, 2, 30 - 6)
    torch.testing.assert_close(mean[0].double(), ref_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cov[0].double(), ref_cov, atol=1e-5, rtol=1e-5)


def test_streaming_equals_fresh_recomputation_after_thousands_of_steps():
    torch.manual_seed(0)
    window = Window(16, 4)
    T0, steps, d = 40, 3000, 8
    keys = (torch.randn(1, 2, T0 + steps, d) + 100.0).float()
    source = CurrentMoments()
    source.prefill(0, keys[:, :, :T0], None, window)
    for T in range(T0 + 1, T0 + steps + 1):
        source.append(0, keys[:, :, :T], None, window)
    T = T0 + steps
    state = source.state(0)
    assert state.count.tolist() == [[T - 16.0, T - 16.0]]
    ref_mean, ref_cov = reference_moments(keys, 4, T - 12)
    torch.testing.assert_close(state.mean[0], ref_mean, atol=1e-10, rtol=1e-12)
    torch.testing.assert_close(state.m2[0] / (T - 16), ref_cov, atol=1e-10, rtol=1e-9)
    mean, cov = source.moments(0, keys, None, window)
    torch.testing.assert_close(cov[0].double(), ref_cov, atol=1e-5, rtol=1e-5)


def test_short_row_bulk_starts_empty_then_grows():
    window = Window(8, 2)
    keys = torch.randn(1, 1, 20, 3)
    source = CurrentMoments()
    source.prefill(0, keys[:, :, :5], None, window)
    assert source.state(0).count.item() == 0
    mean, cov = source.moments(0, keys[:, :, :5], None, window)
    assert torch.all(mean == 0) and torch.all(cov == 0)
    for T in range(6, 21):
        source.append(0, keys[:, :, :T], None, window)
        assert source.state(0).count.item() == max(0, T - 8)
    ref_mean, ref_cov = reference_moments(keys, 2, 20 - 6)
    torch.testing.assert_close(source.state(0).mean[0], ref_mean)
    torch.testing.assert_close(source.state(0).m2[0] / 12, ref_cov)


@pytest.mark.parametrize("jump", [1, 3])
def test_batch_with_left_padding_equals_per_row(jump):
    torch.manual_seed(1)
    window = Window(6, 2)
    starts = torch.tensor([0, 5, 11])
    T0, T1 = 14, 60
    keys = torch.randn(3, 2, T1, 4) * 2 + 10
    batched = CurrentMoments()
    batched.prefill(0, keys[:, :, :T0], starts, window)
    for T in range(T0 + jump, T1 + 1, jump):
        batched.append(0, keys[:, :, :T], starts, window)
        if T % 7 == 0:  # check along the way, rows of different lengths (one without a bulk at first)
            state = batched.state(0)
            mask = bulk_mask(T, 6, 2, starts)
            for r in range(3):
                single = CurrentMoments()
                row = keys[r : r + 1, :, int(starts[r]) : T]
                single.prefill(0, row, None, window)
                assert state.count[r].tolist() == [float(mask[r].sum())] * 2
                torch.testing.assert_close(state.mean[r], single.state(0).mean[0])
                torch.testing.assert_close(state.m2[r], single.state(0).m2[0])


def test_freeze_keeps_prefill_moments():
    window = Window(8, 2)
    keys = torch.randn(2, 2, 50, 4)
    frozen, streaming = CurrentMoments(freeze=True), CurrentMoments()
    for source in (frozen, streaming):
        source.prefill(3, keys[:, :, :30], None, window)
    after_prefill = [t.clone() for t in frozen.moments(3, keys[:, :, :30], None, window)]
    for T in range(31, 51):
        frozen.append(3, keys[:, :, :T], None, window)
        streaming.append(3, keys[:, :, :T], None, window)
    for a, b in zip(frozen.moments(3, keys, None, window), after_prefill, strict=True):
        assert torch.equal(a, b)
    assert not torch.allclose(streaming.moments(3, keys, None, window).cov, after_prefill[1])


def test_moments_self_synchronise_and_errors():
    window = Window(8, 2)
    keys = torch.randn(1, 2, 40, 4)
    lazy, eager = CurrentMoments(), CurrentMoments()
    lazy.moments(0, keys[:, :, :20], None, window)  # prefills
    eager.prefill(0, keys[:, :, :20], None, window)
    for T in range(21, 41):
        eager.append(0, keys[:, :, :T], None, window)
    lazy_m = lazy.moments(0, keys, None, window)  # catches up 20 steps at once
    torch.testing.assert_close(lazy_m.cov, eager.moments(0, keys, None, window).cov)
    with pytest.raises(ValueError, match="grow"):
        eager.append(0, keys[:, :, :30], None, window)
    eager.reset()
    with pytest.raises(RuntimeError, match="before prefill"):
        eager.append(0, keys, None, window)


@pytest.mark.parametrize("k", [2, 5])
def test_block_updates_are_exact_at_block_ends_and_at_most_k_minus_1_steps_old(k):
    torch.manual_seed(1)
    window = Window(16, 4)
    T0, steps, d = 30, 23, 8
    keys = torch.randn(2, 2, T0 + steps, d) + 3.0
    start = torch.tensor([0, 20])  # the second row has no bulk at first (10 real tokens)
    blocked, reference = CurrentMoments(update_every=k), CurrentMoments()
    for source in (blocked, reference):
        source.prefill(0, keys[:, :, :T0], start, window)
    last_block_end = T0
    for T in range(T0 + 1, T0 + steps + 1):
        blocked.append(0, keys[:, :, :T], start, window)
        reference.append(0, keys[:, :, :T], start, window)
        if (T - T0) % k == 0:
            last_block_end = T
            torch.testing.assert_close(blocked.moments(0, keys[:, :, :T], start, window),
                                       reference.moments(0, keys[:, :, :T], start, window))
        assert T - last_block_end < k
        fresh = CurrentMoments()
        fresh.prefill(0, keys[:, :, :last_block_end], start, window)
        torch.testing.assert_close(blocked.moments(0, keys[:, :, :T], start, window),
                                   fresh.moments(0, keys[:, :, :last_block_end], start, window))
    with pytest.raises(ValueError, match="update_every to be an int >= 1"):
        CurrentMoments(update_every=0)
