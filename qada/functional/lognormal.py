"""The lognormal bulk estimate (paper eqs. 5-7).

If bulk keys are ``k ~ N(mu_K, Sigma_K)`` then ``s = scale * q·k ~ N(mu_s, sigma_s^2)`` with

.. math::

    \\mu_s = \\text{scale}\\, q^\\top \\mu_K, \\qquad \\sigma_s^2 = \\text{scale}^2\\, q^\\top \\Sigma_K q,

and ``E[exp(s)] = exp(mu_s + sigma_s^2 / 2)``, so ``log A_bulk ≈ log T_bulk + mu_s + sigma_s^2 / 2``.
Moments are per KV head and shared by the ``G`` query heads of a group (GQA).
"""

from __future__ import annotations

import torch

from qada.functional.capping import log_mean_exp_score
from qada.functional.checks import accumulation_dtype, check_float, check_ndim, group_size

__all__ = ["log_bulk_from_mean_exp", "lognormal_log_bulk_from_moments", "lognormal_log_bulk_mass",
           "lognormal_score_moments"]


def lognormal_score_moments(
    query: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu_s, sigma_s^2)``, each ``[b, H]``, from query ``[b, H, d]``, mean ``[b, H_kv, d]``, cov ``[b, H_kv, d, d]``.

    Accumulates in float32 (float64 if any input is float64); half-precision inputs are upcast first.
    """
    for name, tensor in (("query", query), ("mean", mean), ("cov", cov)):
        check_float(name, tensor)
    check_ndim("query", query, 3, "[batch, heads, head_dim]")
    check_ndim("mean", mean, 3, "[batch, kv_heads, head_dim]")
    check_ndim("cov", cov, 4, "[batch, kv_heads, head_dim, head_dim]")
    b, H, d = query.shape
    H_kv = mean.shape[1]
    if mean.shape != (b, H_kv, d) or cov.shape != (b, H_kv, d, d):
        raise ValueError(
            f"expected mean [{b}, kv_heads, {d}] and cov [{b}, kv_heads, {d}, {d}] for query {tuple(query.shape)} "
            f"but got mean {tuple(mean.shape)} and cov {tuple(cov.shape)}"
        )
    group_size(H, H_kv)
    return score_moments_unchecked(query, mean, cov, scale)


def score_moments_unchecked(
    query: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lognormal_score_moments` without the input checks (for the decode step, which validated them)."""
    b, H, d = query.shape
    H_kv = mean.shape[1]
    dtype = accumulation_dtype(query, mean, cov)
    q = query.to(dtype).view(b, H_kv, H // H_kv, d)  # the G query heads of each KV head
    mu_s = scale * (q @ mean.to(dtype)[..., None])[..., 0]  # [b, H_kv, G]
    var_s = scale * scale * ((q @ cov.to(dtype)) * q).sum(-1)  # q Sigma q^T per query head
    return mu_s.reshape(b, H), var_s.reshape(b, H)


def lognormal_log_bulk_mass(
    query: torch.Tensor,
    mean: torch.Tensor,
    cov: torch.Tensor,
    t_bulk: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``log Â_bulk = log T_bulk + mu_s + sigma_s^2 / 2`` (paper eq. 7), ``[b, H]``.

    Args:
        query: ``[b, H, d]`` RoPE-rotated decode queries.
        mean, cov: ``[b, H_kv, d]`` and ``[b, H_kv, d, d]`` bulk key moments (population covariance).
        t_bulk: ``[b]`` bulk size of each row *of the current prompt*; 0 gives ``-inf`` (no bulk).
        scale: the attention scaling, normally ``1/sqrt(d)``.
    """
    return lognormal_log_bulk_from_moments(*lognormal_score_moments(query, mean, cov, scale), t_bulk)


def lognormal_log_bulk_from_moments(mu_s: torch.Tensor, var_s: torch.Tensor, t_bulk: torch.Tensor,
                                    softcap: float | None = None) -> torch.Tensor:
    """``log T_bulk + mu_s + sigma_s^2 / 2`` from score moments ``[b, H]`` and ``t_bulk [b]`` (``-inf`` if 0); with a
    logit ``softcap`` ``c``, ``log T_bulk + log E[exp(c tanh(s / c))]`` (:mod:`qada.functional.capping`)."""
    check_ndim("t_bulk", t_bulk, 1, "[batch]")
    if t_bulk.shape[0] != mu_s.shape[0]:
        raise ValueError(f"expected t_bulk of shape [{mu_s.shape[0]}] but got {tuple(t_bulk.shape)}")
    return log_bulk_from_mean_exp(log_mean_exp_score(mu_s, var_s, softcap), t_bulk)


def log_bulk_from_mean_exp(log_mean_exp: torch.Tensor, t_bulk: torch.Tensor) -> torch.Tensor:
    """``log T_bulk + log E[exp(s)]`` (eq. 7) from each head's ``log_mean_exp [b, H]`` of one bulk score and
    ``t_bulk [b]`` (``-inf`` where 0); unchecked."""
    log_t = torch.log(t_bulk.to(device=log_mean_exp.device, dtype=log_mean_exp.dtype))[:, None]
    return (log_t + log_mean_exp).masked_fill(t_bulk.to(log_mean_exp.device)[:, None] <= 0, float("-inf"))
