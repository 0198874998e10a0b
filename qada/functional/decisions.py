"""Threshold decisions on the local ratio (paper eq. 2 for the oracle, eq. 7 for QAdA), fail safe.

A head is local when ``A_local / (A_local + A_bulk) >= tau``, computed in log space. A row without a bulk
(``T_bulk = 0``) is trivially local. Any non-finite value where a bulk exists (NaN, ``±inf`` from an overflowing
estimate) makes the head dense: never a silent local decision on a broken estimate.
"""

from __future__ import annotations

import math

import torch

__all__ = ["finite_threshold_decision", "log_local_ratio", "local_ratio"]


def log_local_ratio(log_local: torch.Tensor, log_bulk: torch.Tensor) -> torch.Tensor:
    """``log(A_local / (A_local + A_bulk))``, ``[b, H]``; 0 when the bulk is empty (``log_bulk = -inf``)."""
    return log_local - torch.logaddexp(log_local, log_bulk)


def local_ratio(log_local: torch.Tensor, log_bulk: torch.Tensor) -> torch.Tensor:
    """The local ratio ``A_local / (A_local + A_bulk)`` in ``[0, 1]`` (paper eq. 2), ``[b, H]``."""
    return log_local_ratio(log_local, log_bulk).exp()


def check_threshold(name: str, value: float) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number in ``[0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"expected {name} in [0, 1] but got {value!r}")


def finite_threshold_decision(
    log_local: torch.Tensor,
    log_bulk: torch.Tensor,
    tau: float,
    has_bulk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local decisions ``[b, H]`` and the fail-safe mask ``[b, H]`` of heads forced dense by a non-finite value.

    Args:
        log_local, log_bulk: ``[b, H]`` log masses (``log_bulk`` exact or estimated).
        tau: threshold in ``[0, 1]``.
        has_bulk: ``[b]`` bool, False for rows with ``T_bulk = 0`` (always local).
    """
    check_threshold("tau", tau)
    no_bulk = ~has_bulk.to(log_local.device)[:, None]
    broken = ~(torch.isfinite(log_local) & torch.isfinite(log_bulk)) & ~no_bulk
    log_tau = math.log(tau) if tau > 0 else float("-inf")
    local = (log_local_ratio(log_local, log_bulk) >= log_tau) & ~broken
    return local | no_bulk, broken
