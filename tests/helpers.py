"""Builders shared by the tests: synthetic decode steps with known moments."""

from __future__ import annotations

import torch

from qada.moments import BulkMoments


def population_moments(keys: torch.Tensor) -> BulkMoments:
    """Mean ``[b, H_kv, d]`` and population covariance ``[b, H_kv, d, d]`` of ``keys [b, H_kv, N, d]`` (float64)."""
    keys = keys.double()
    mean = keys.mean(2)
    centred = keys - mean[:, :, None]
    return BulkMoments(mean, centred.transpose(-1, -2) @ centred / keys.shape[2])


def random_psd(d: int, generator: torch.Generator, rank: int | None = None) -> torch.Tensor:
    """A random positive semi-definite ``[d, d]`` matrix in float64."""
    a = torch.randn(d, rank or d, generator=generator, dtype=torch.float64)
    return a @ a.T / (rank or d)
