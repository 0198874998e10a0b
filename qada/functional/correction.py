"""A per-head affine correction of QAdA's lognormal bulk estimate (paper eq. 7), and its least-squares fit.

The lognormal estimate ``log Â_bulk = log T_bulk + mu_s + sigma_s^2/2`` is exact for Gaussian keys; on real keys
its error is systematic per head (paper Table 2). The correction keeps the ``log T_bulk`` term (the bulk mass grows
with the number of bulk keys) and corrects the per-key part ``m = mu_s + sigma_s^2/2`` (eqs. 5-6: the log of the
mean ``exp(s)`` of one bulk key) affinely, per layer ``l`` and query head ``h``:

.. math:: \\log \\hat A'_\\text{bulk} = \\log T_\\text{bulk} + a_{lh}\\,(\\mu_s + \\sigma_s^2/2) + b_{lh}
    = \\log \\hat A_\\text{bulk} + (a_{lh} - 1)(\\log \\hat A_\\text{bulk} - \\log T_\\text{bulk}) + b_{lh}

``a = 1, b = 0`` is the identity: :func:`apply_log_correction` then returns the estimate bit for bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["LogCorrection", "apply_log_correction", "fit_log_correction"]


class LogCorrection(NamedTuple):
    """A fitted correction: ``slope`` and ``offset`` ``[L, H]`` (float32) and the ``count`` ``[L, H]`` (int64) of
    finite samples each head was fitted on."""

    slope: torch.Tensor
    offset: torch.Tensor
    count: torch.Tensor


def apply_log_correction(
    estimate: torch.Tensor, per_key: torch.Tensor, slope: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """The corrected ``log Â'_bulk = log Â_bulk + (a - 1) m + b``, with ``m = mu_s + sigma_s^2/2``.

    Args:
        estimate: ``[..., H]`` the lognormal ``log Â_bulk`` (paper eq. 7).
        per_key: ``[..., H]`` its per-key part ``m = log Â_bulk - log T_bulk = mu_s + sigma_s^2/2``.
        slope, offset: ``a, b`` broadcastable to ``estimate`` (e.g. ``[H]`` for one layer).

    A non-finite estimate stays non-finite (the criterion's fail-safe makes such a head dense); with ``a = 1,
    b = 0`` the result equals ``estimate`` exactly.
    """
    slope = slope.to(device=estimate.device, dtype=estimate.dtype)
    offset = offset.to(device=estimate.device, dtype=estimate.dtype)
    return estimate + (slope - 1) * per_key.to(estimate.dtype) + offset


def fit_log_correction(
    estimate: torch.Tensor, truth: torch.Tensor, log_t_bulk: torch.Tensor, ridge: float = 1.0,
    quantile: float | None = None,
) -> LogCorrection:
    """Fit ``slope, offset`` per head so that the corrected estimate matches the exact ``log A_bulk``.

    With ``x = log Â_bulk - log T_bulk`` and ``y = log A_bulk - log T_bulk`` over the ``n`` samples of a head
    where all three inputs are finite (NaN/inf samples are ignored), the fit is least squares on centred data with
    a ridge ``lambda`` that pulls the slope toward 1 and the offset toward 0:

    .. math:: a = \\frac{S_{xy} + \\lambda}{S_{xx} + \\lambda}, \\qquad
        b = \\frac{n}{n + \\lambda}\\,(\\bar y - a \\bar x),

    with ``S_xx = sum (x - x̄)^2`` and ``S_xy = sum (x - x̄)(y - ȳ)``. A perfect estimator (``y = x``) gives
    exactly ``a = 1, b = 0``; a head without samples gives the identity (``count`` 0: e.g. every head of a hybrid
    model's sliding-window layer, whose samples are all NaN since it is never decided); a head whose ``x`` does not
    vary keeps ``a = 1`` and only corrects the mean error. Sums are taken in float64.

    Args:
        estimate: ``[N, L, H]`` lognormal estimates ``log Â_bulk`` (any leading sample dims, last two ``L, H``).
        truth: like ``estimate``: the exact ``log A_bulk`` of the same decisions.
        log_t_bulk: ``log T_bulk``, broadcastable to ``estimate`` (e.g. ``[N, 1, 1]``).
        ridge: ``lambda >= 0`` (in squared nats for the slope, in samples for the offset).
        quantile: ``None`` (least squares, above) or ``q`` in ``(0, 1)``: the offset is then the ``q``-quantile of
            the residuals ``y - a x`` of the head (shrunk by ``n / (n + lambda)`` like the mean), so that the
            corrected estimate is at least the exact mass in a fraction ``q`` of the calibration steps. A high
            ``q`` is conservative: an underestimated bulk makes a head local that needs the context, an
            overestimated one only costs sparsity, which ``tau`` buys back.

    Returns:
        :class:`LogCorrection` with ``[L, H]`` tensors.
    """
    if not isinstance(estimate, torch.Tensor) or not isinstance(truth, torch.Tensor):
        raise ValueError("expected estimate and truth to be tensors")
    if estimate.ndim < 2 or estimate.shape != truth.shape:
        raise ValueError(f"expected estimate and truth of one shape [samples, layers, heads] but got "
                         f"{tuple(estimate.shape)} and {tuple(truth.shape)}")
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not math.isfinite(ridge) or ridge < 0:
        raise ValueError(f"expected ridge to be a finite float >= 0 but got {ridge!r}")
    if quantile is not None and (isinstance(quantile, bool) or not isinstance(quantile, (int, float))
                                 or not 0 < quantile < 1):
        raise ValueError(f"expected quantile to be None or a number in (0, 1) but got {quantile!r}")
    L, H = estimate.shape[-2:]
    log_t = torch.as_tensor(log_t_bulk, dtype=torch.float64).broadcast_to(estimate.shape).reshape(-1, L, H)
    estimate = estimate.detach().to("cpu", torch.float64).reshape(-1, L, H)
    truth = truth.detach().to("cpu", torch.float64).reshape(-1, L, H)
    x, y = estimate - log_t.cpu(), truth - log_t.cpu()
    valid = torch.isfinite(x) & torch.isfinite(y)
    x, y = torch.where(valid, x, 0.0), torch.where(valid, y, 0.0)
    n = valid.sum(0).to(torch.float64)
    safe_n = n.clamp(min=1)
    x_mean, y_mean = x.sum(0) / safe_n, y.sum(0) / safe_n
    dx, dy = torch.where(valid, x - x_mean, 0.0), torch.where(valid, y - y_mean, 0.0)
    sxx, sxy = (dx * dx).sum(0), (dx * dy).sum(0)
    denominator = sxx + ridge
    slope = torch.where(denominator > 0, (sxy + ridge) / denominator.clamp(min=1e-300), torch.ones_like(sxx))
    shrink = torch.where(n + ridge > 0, n / (n + ridge).clamp(min=1e-300), torch.zeros_like(n))
    if quantile is None:
        offset = shrink * (y_mean - slope * x_mean)
    else:
        residual = torch.where(valid, y - slope * x, float("nan"))
        offset = shrink * torch.nan_to_num(torch.nanquantile(residual, float(quantile), dim=0), nan=0.0)
    return LogCorrection(slope.float(), offset.float(), n.long())
