"""Containers for bulk key moments."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["BulkMoments"]


class BulkMoments(NamedTuple):
    """Mean ``[b, H_kv, d]`` and population covariance ``[b, H_kv, d, d]`` of the bulk keys, per KV head."""

    mean: torch.Tensor
    cov: torch.Tensor
