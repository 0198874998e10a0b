"""Pure moment math: moments of a key block, Chan merge, rank-1 (Welford) update, shifted sums.

A :class:`MomentState` holds, per leading index (``[...]``, e.g. ``[b, H_kv]``), the count ``n``, the mean
and the co-moment ``M2 = Σ (k - mean)(k - mean)ᵀ`` in float64, so the population covariance is ``M2 / n``:

.. math::

    \\mu = \\frac{1}{n}\\sum_i k_i, \\qquad \\Sigma = \\frac{1}{n}\\sum_i (k_i - \\mu)(k_i - \\mu)^\\top .

Merging two states (Chan et al.) and adding one key (Welford) are exact in exact arithmetic and stable in
floating point: no ``E[kkᵀ] - μμᵀ`` cancellation, so a key offset of 100 costs no digits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qada.step import BulkMoments

__all__ = [
    "MomentState",
    "add_key",
    "block_moments",
    "empty_state",
    "merge_moments",
    "shifted_sums",
    "state_from_shifted_sums",
    "to_bulk_moments",
]


class MomentState(NamedTuple):
    """Count ``[...]``, mean ``[..., d]`` and co-moment ``M2 [..., d, d]``, all float64."""

    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor


def empty_state(shape: tuple[int, ...], d: int, device: torch.device | str | None = None) -> MomentState:
    """A state with no keys (count 0, zero mean and co-moment)."""
    f64 = torch.float64
    return MomentState(
        torch.zeros(shape, dtype=f64, device=device),
        torch.zeros(*shape, d, dtype=f64, device=device),
        torch.zeros(*shape, d, d, dtype=f64, device=device),
    )


def block_moments(keys: torch.Tensor, mask: torch.Tensor | None = None) -> MomentState:
    """Moments of the keys ``[..., N, d]`` where ``mask [..., N]`` (broadcastable) is True, in float64.

    Two passes (mean, then centred co-moment): exact up to float64 rounding whatever the offset of the keys.
    An empty selection gives count 0 and zeros.
    """
    x = keys.to(torch.float64)
    if mask is None:
        w = torch.ones(x.shape[:-1], dtype=torch.float64, device=x.device)
    else:
        w = torch.broadcast_to(mask.to(device=x.device, dtype=torch.float64), x.shape[:-1])
    count = w.sum(-1)
    mean = (w[..., None] * x).sum(-2) / count.clamp(min=1.0)[..., None]
    centred = (x - mean[..., None, :]) * w[..., None]
    m2 = centred.transpose(-1, -2) @ centred
    return MomentState(count, mean, m2)


def merge_moments(a: MomentState, b: MomentState) -> MomentState:
    """Chan's parallel merge: the moments of the union of two disjoint key sets (either may be empty)."""
    n = a.count + b.count
    safe_n = n.clamp(min=1.0)
    delta = b.mean - a.mean
    mean = a.mean + delta * (b.count / safe_n)[..., None]
    correction = (a.count * b.count / safe_n)[..., None, None] * (delta[..., :, None] * delta[..., None, :])
    return MomentState(n, mean, a.m2 + b.m2 + correction)


def add_key(state: MomentState, key: torch.Tensor, weight: torch.Tensor | None = None) -> MomentState:
    """Welford's rank-1 update: add ``key [..., d]`` where ``weight [...]`` is 1 (0 leaves the state as is).

    O(d) for the mean and O(d²) for the co-moment.
    """
    x = key.to(device=state.mean.device, dtype=torch.float64)
    if weight is None:
        w = torch.ones_like(state.count)
    else:
        w = torch.broadcast_to(weight.to(device=state.count.device, dtype=torch.float64), state.count.shape)
    n = state.count + w
    delta = x - state.mean
    mean = state.mean + delta * (w / n.clamp(min=1.0))[..., None]
    m2 = state.m2 + w[..., None, None] * (delta[..., :, None] * (x - mean)[..., None, :])
    return MomentState(n, mean, m2)


def to_bulk_moments(state: MomentState, dtype: torch.dtype = torch.float32) -> BulkMoments:
    """Mean and population covariance ``M2 / n`` in ``dtype``; zeros where the count is 0."""
    n = state.count.clamp(min=1.0)
    cov = state.m2 / n[..., None, None]
    cov = 0.5 * (cov + cov.transpose(-1, -2))
    return BulkMoments(state.mean.to(dtype), cov.to(dtype))


def shifted_sums(keys: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(n, Σ (k - c), Σ (k - c)(k - c)ᵀ)`` of keys ``[..., N, d]`` around ``shift c [..., d]``, float64.

    Sums around a shift close to the mean are additive (prefix sums, sliding ranges) and keep their precision.
    """
    x = keys.to(torch.float64) - shift.to(device=keys.device, dtype=torch.float64)[..., None, :]
    n = torch.full(x.shape[:-2], float(x.shape[-2]), dtype=torch.float64, device=x.device)
    return n, x.sum(-2), x.transpose(-1, -2) @ x


def state_from_shifted_sums(
    count: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, shift: torch.Tensor
) -> MomentState:
    """The :class:`MomentState` of keys whose shifted sums around ``shift`` are ``(count, s1, s2)``."""
    n = count.clamp(min=1.0)
    centred_mean = s1 / n[..., None]
    m2 = s2 - count[..., None, None] * (centred_mean[..., :, None] * centred_mean[..., None, :])
    mean = torch.where(count[..., None] > 0, centred_mean + shift.to(torch.float64), torch.zeros_like(s1))
    return MomentState(count, mean, m2)
