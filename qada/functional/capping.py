"""Two attention features some model families add to the softmax: logit soft-capping and learned sink logits.

**Soft-capping** (Gemma-2): every score passes through ``cap(s) = c tanh(s / c)`` before the softmax, so no score
exceeds ``c``. The oracle decides on capped scores; the lognormal estimate (eq. 7) becomes, for bulk scores
``s ~ N(mu_s, sigma_s^2)``,

.. math:: \\log \\hat A_\\text{bulk} = \\log T_\\text{bulk} + \\log E\\left[e^{c \\tanh(s / c)}\\right],
    \\qquad E\\left[e^{c \\tanh(s / c)}\\right] \\approx \\frac{1}{\\sqrt\\pi}
    \\sum_{j=1}^{n} w_j\\, e^{c \\tanh((\\mu_s + \\sqrt{2}\\, \\sigma_s x_j) / c)}

(Gauss-Hermite quadrature with nodes ``x_j`` and weights ``w_j``; the integrand is bounded by ``e^c``, so ``n = 48``
nodes reach float32 accuracy for the caps models use). Without a cap it is ``mu_s + sigma_s^2 / 2`` exactly.

**Sink logits** (gpt-oss, ``s_aux``): each query head ``h`` has a learned logit ``z_h`` that joins the softmax's
denominator as one more, always attended, score whose value is zero: ``p_i = e^{s_i} / (sum_j e^{s_j} + e^{z_h})``.
It is part of what a local head keeps, so it joins the local mass: ``A_local + e^{z_h}``.
"""

from __future__ import annotations

import math

import torch

from qada.functional.checks import check_positive

__all__ = [
    "GAUSS_HERMITE_NODES",
    "add_sink_logits",
    "capped_log_mean_exp",
    "hermite_rule",
    "log_mean_exp_score",
    "sink_output_scale",
    "soft_cap",
    "softmax_with_sink_column",
    "softmax_with_sinks",
]

GAUSS_HERMITE_NODES = 48
"""Quadrature nodes of :func:`capped_log_mean_exp`."""


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``c * tanh(scores / c)`` (logit soft-capping); ``scores`` unchanged when ``cap`` is ``None``."""
    if cap is None:
        return scores
    return torch.tanh(scores / cap) * cap


_RULES: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}


def hermite_rule(n: int = GAUSS_HERMITE_NODES) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Nodes and ``log(w_j / sqrt(pi))`` of the ``n``-point Gauss-Hermite rule (weight ``e^{-x^2}``), computed once
    (by numpy) and kept: call it eagerly before a traced step uses the rule, which then reads constants."""
    rule = _RULES.get(n)
    if rule is None:
        import numpy as np

        nodes, weights = np.polynomial.hermite.hermgauss(n)
        rule = _RULES[n] = (tuple(float(x) for x in nodes),
                            tuple(float(math.log(w) - 0.5 * math.log(math.pi)) for w in weights))
    return rule


def capped_log_mean_exp(mu: torch.Tensor, var: torch.Tensor, cap: float, nodes: int = GAUSS_HERMITE_NODES
                        ) -> torch.Tensor:
    """``log E[exp(c tanh(s / c))]`` for ``s ~ N(mu, var)``, elementwise over ``mu, var [...]`` (Gauss-Hermite,
    module docstring); accumulates in float64 for float64 inputs, else float32."""
    check_positive("the soft cap", cap)
    x, log_w = hermite_rule(nodes)
    dtype = torch.float64 if mu.dtype == torch.float64 else torch.float32
    x_t = torch.tensor(x, dtype=dtype, device=mu.device)
    log_w_t = torch.tensor(log_w, dtype=dtype, device=mu.device)
    sigma = var.to(dtype).clamp(min=0).sqrt()
    s = mu.to(dtype)[..., None] + math.sqrt(2.0) * sigma[..., None] * x_t  # [..., n]
    return torch.logsumexp(log_w_t + soft_cap(s, cap), dim=-1)


def log_mean_exp_score(mu: torch.Tensor, var: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    """``log E[exp(cap(s))]`` for bulk scores ``s ~ N(mu, var)``: ``mu + var / 2`` (eq. 7's lognormal mean) without
    a cap, the Gauss-Hermite value of :func:`capped_log_mean_exp` with one."""
    if cap is None:
        return mu + 0.5 * var
    return capped_log_mean_exp(mu, var, cap).to(mu.dtype)


def add_sink_logits(log_mass: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """``log(A + e^{z_h})``: ``log_mass [b, H]`` with each head's sink logit ``sink_logits [H]`` added to its mass
    (``log_mass`` unchanged for ``None``)."""
    if sink_logits is None:
        return log_mass
    return torch.logaddexp(log_mass, sink_logits.to(device=log_mass.device, dtype=log_mass.dtype)[None, :])


def sink_output_scale(log_mass: torch.Tensor, sink_logits: torch.Tensor) -> torch.Tensor:
    """``A / (A + e^{z_h}) = sigmoid(log A - z_h)``, ``[b, H]``: what an attention output computed without the sink
    (softmax over the attended scores, whose log-sum-exp is ``log_mass [b, H]``) is multiplied by to include it."""
    return torch.sigmoid(log_mass - sink_logits.to(device=log_mass.device, dtype=log_mass.dtype)[None, :])


def softmax_with_sinks(scores: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of ``scores [b, H, ..., N]`` with each head's sink logit ``sink_logits [H]``
    in the denominator (probabilities that sum to less than one); a plain softmax for ``None``."""
    if sink_logits is None:
        return torch.softmax(scores, dim=-1)
    H = scores.shape[1]
    return softmax_with_sink_column(scores, sink_logits.view(1, H, *([1] * (scores.dim() - 2))))


def softmax_with_sink_column(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of ``scores [..., N]`` with one more logit ``sink`` (broadcast to
    ``scores[..., :1]``) in the denominator, that sink's probability dropped."""
    sink = sink.to(device=scores.device, dtype=scores.dtype)
    joined = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(joined, dim=-1)[..., :-1]
