"""The QAdA decision of one decode step as one pure function of fixed-shape tensors (paper eqs. 2, 5-7).

Every input keeps its shape while the cache grows (the window has ``W = min(T, T_local)`` slots, the moments are
``[b, H_kv, d(, d)]``), so ``torch.compile`` compiles it once per shape and never again while decoding; that is
what :class:`qada.criteria.QAdACriterion` does with ``compile=True``. Eagerly it runs the same operations as the
decode step's lazy path (``DecodeStep.log_local``, ``log_bulk_estimate``, :func:`finite_threshold_decision`).
"""

from __future__ import annotations

import torch

__all__ = ["qada_threshold_decision"]


def qada_threshold_decision(
    query: torch.Tensor,
    window_keys: torch.Tensor,
    window_valid: torch.Tensor | None,
    mean: torch.Tensor,
    cov: torch.Tensor,
    t_bulk: torch.Tensor,
    scale: float,
    log_tau: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local [b, H], fail_safe [b, H])`` of QAdA at threshold ``exp(log_tau)``.

    Args:
        query: ``[b, H, d]`` decode queries; ``window_keys``: ``[b, H_kv, W, d]``; ``window_valid``: ``[b, W]``
            bool or ``None`` (every slot valid); ``mean``, ``cov``: ``[b, H_kv, d]``, ``[b, H_kv, d, d]`` bulk key
            moments; ``t_bulk``: ``[b]`` bulk sizes (0: no bulk, always local); ``log_tau``: ``log tau``.
    """
    b, H, d = query.shape
    H_kv = window_keys.shape[1]
    dtype = torch.float64 if torch.float64 in (query.dtype, window_keys.dtype) else torch.float32
    rows = query.to(dtype).view(b, H_kv, H // H_kv, d)  # the G query heads of each KV head
    scores = (torch.einsum("bkgd,bknd->bkgn", rows, window_keys.to(dtype)) * scale).reshape(b, H, -1)
    if window_valid is not None:
        scores = torch.where(window_valid[:, None, :], scores, scores.new_full((), float("-inf")))
    log_local = torch.logsumexp(scores, dim=-1)  # [b, H]  (eq. 2's numerator)
    mdtype = torch.float64 if torch.float64 in (query.dtype, mean.dtype, cov.dtype) else torch.float32
    q = query.to(mdtype).view(b, H_kv, H // H_kv, d)
    mu_s = (scale * (q @ mean.to(mdtype)[..., None])[..., 0]).reshape(b, H)  # eq. 5
    var_s = (scale * scale * ((q @ cov.to(mdtype)) * q).sum(-1)).reshape(b, H)  # eq. 6
    has_bulk = t_bulk[:, None] > 0
    estimate = torch.log(t_bulk.to(mu_s.dtype))[:, None] + mu_s + 0.5 * var_s  # eq. 7
    estimate = torch.where(has_bulk, estimate, estimate.new_full((), float("-inf")))
    broken = ~(torch.isfinite(log_local) & torch.isfinite(estimate)) & has_bulk
    ratio = log_local - torch.logaddexp(log_local, estimate)
    local = (ratio >= log_tau) & ~broken
    return local | ~has_bulk, broken
