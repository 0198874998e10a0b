"""Attention over the window plus an extra set of bulk tokens per head (issue 32: local heads attend to what they
read; Quest's top pages).

A criterion that scores some bulk tokens exactly (the tail-aware criteria's exact set ``E``, Quest's top pages) has
read their keys already; reading their values too, a local head attends over ``window ∪ E`` instead of the window
alone. Both parts are softmax attentions over disjoint sets, merged by their masses:

.. math:: o = \\frac{A_\\text{local}\\, o_\\text{local} + A_E\\, o_E}{A_\\text{local} + A_E}

with ``A_local`` the window's mass plus the sink logits (the executor's output ``o_local`` is normalised by it) and
``A_E = sum_{i in E} e^{s_i}``.
"""

from __future__ import annotations

import torch

from qada.functional.capping import soft_cap

__all__ = ["attend_extra", "extra_scores", "merge_extra", "merge_masses"]


def extra_scores(query: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, scale: float,
                 softcap: float | None = None) -> torch.Tensor:
    """``[b, H, n]`` float32 scores of ``query [b, H, d]`` against the keys at ``slots [b, H, n]`` (each query head
    its own slots) of ``keys [b, H_kv, C, d]``; slots must lie in ``[0, C)``."""
    gathered = _by_query_head(keys, slots).float()  # [b, H, n, d]
    return soft_cap(scale * (gathered @ query.float()[..., None])[..., 0], softcap)


def _by_query_head(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x [b, H_kv, C, d]`` at ``slots [b, H, n]``, each query head from its KV head: ``[b, H, n, d]``."""
    b, H = slots.shape[:2]
    rows = torch.arange(b, device=x.device)[:, None, None]
    groups = (torch.arange(H, device=x.device) // (H // x.shape[1]))[None, :, None]
    return x[rows, groups, slots]


def attend_extra(values: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, scores: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each head over its extra set: ``(output [b, H, d] float32, log A_E [b, H])`` from the
    set's ``scores [b, H, n]`` (:func:`extra_scores`, as its criterion computed them) and ``values [b, H_kv, C, d]``;
    ``slots, valid [b, H, n]`` (invalid entries are not attended; an empty set gives ``0`` and ``-inf``)."""
    scores = scores.float().masked_fill(~valid, float("-inf"))
    log_mass = torch.logsumexp(scores, dim=-1)  # [b, H]
    weights = (scores - log_mass[..., None]).exp().nan_to_num(0.0)  # an empty set: all zero
    gathered = _by_query_head(values, slots).float()  # [b, H, n, d]
    return (weights[..., None, :] @ gathered)[..., 0, :], log_mass  # a product: compiled, gathered into a buffer


def merge_masses(output: torch.Tensor, log_local: torch.Tensor, extra_output: torch.Tensor, log_extra: torch.Tensor
                 ) -> torch.Tensor:
    """Every head's attention over ``window ∪ E`` (module docstring), ``[b, H, d]`` float32: ``output [b, H, d]`` the
    window's (normalised by ``log_local [b, H]``, the window's mass plus the sink logits) merged with
    ``extra_output [b, H, d]`` of mass ``log_extra [b, H]`` (``-inf``: an empty set, ``output`` kept)."""
    total = torch.logaddexp(log_local, log_extra)
    keep = (log_local - total).exp().nan_to_num(1.0)[..., None]  # [b, H, 1]; no extra mass: keep all
    take = (log_extra - total).exp().nan_to_num(0.0)[..., None]
    return keep * output.float() + take * extra_output


def merge_extra(output: torch.Tensor, log_local: torch.Tensor, extra_output: torch.Tensor, log_extra: torch.Tensor,
                local: torch.Tensor) -> torch.Tensor:
    """The local heads' attention over ``window ∪ E`` (:func:`merge_masses`): ``output [b, H, 1, d]`` (the
    executor's, normalised by ``log_local [b, H]``) merged with ``extra_output [b, H, d]`` of mass ``log_extra
    [b, H]``; dense heads (``local`` False) keep ``output``. In ``output``'s dtype."""
    merged = merge_masses(output[:, :, 0], log_local, extra_output, log_extra)
    return torch.where(local[:, :, None, None], merged[:, :, None].to(output.dtype), output)
