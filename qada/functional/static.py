"""Static head masks from recorded oracle frequencies (paper App. A).

On a hybrid model (sliding-window layers beside global ones) only the global layers are ever decided, so only
they have frequencies: a sliding layer's row of the ``[L, H]`` frequencies is entirely NaN ("never decided"). Such
rows take no part in the ranking, ``alpha`` is the fraction of the *global* heads made local (what a run's
``sparsity`` reports), and their mask row is True (a sliding layer reads at most its window; it passes through
qada untouched, so the value is never used).
"""

from __future__ import annotations

import math

import torch

from qada.functional.decisions import check_threshold

__all__ = ["allocate_local_counts", "calibrate_static_mask", "check_local_frequency", "static_local_count",
           "undecided_layers"]


def static_local_count(alpha: float, num_layers: int, num_heads: int) -> int:
    """``round(alpha * L * H)`` with halves rounded up: how many heads the static criterion makes local
    (``L``: the layers that are decided, i.e. the global layers of a hybrid model)."""
    check_threshold("alpha", alpha)
    return int(math.floor(alpha * num_layers * num_heads + 0.5))


def undecided_layers(local_frequency: torch.Tensor) -> torch.Tensor:
    """``[L]`` bool: the layers whose frequencies are all NaN (sliding-window layers of a hybrid model)."""
    return torch.isnan(local_frequency).all(-1) if local_frequency.shape[-1] else torch.zeros(
        local_frequency.shape[0], dtype=torch.bool, device=local_frequency.device)


def check_local_frequency(local_frequency: torch.Tensor, in_unit_interval: bool = False) -> torch.Tensor:
    """Check ``[L, H]`` frequencies: every row finite, or entirely NaN for a layer that is never decided, with at
    least one finite row; with ``in_unit_interval`` (an artifact's frequencies) also floating, with every finite
    value in ``[0, 1]``. Returns :func:`undecided_layers`; raises ``ValueError``."""
    if not isinstance(local_frequency, torch.Tensor) or local_frequency.ndim != 2:
        got = tuple(local_frequency.shape) if isinstance(local_frequency, torch.Tensor) else type(local_frequency)
        raise ValueError(f"expected local_frequency of shape [layers, heads] but got {got}")
    if in_unit_interval and not local_frequency.dtype.is_floating_point:
        raise ValueError(f"expected floating local frequencies but got {local_frequency.dtype}")
    undecided = undecided_layers(local_frequency)
    decided = local_frequency[~undecided]
    if not torch.isfinite(decided).all():
        raise ValueError("expected finite local frequencies (a layer that is never decided, e.g. a sliding-window "
                         "layer, may be all NaN) but got NaN or inf")
    if local_frequency.numel() and bool(undecided.all()):
        raise ValueError("expected finite local frequencies for at least one layer but every layer is NaN "
                         "(no layer was decided)")
    if in_unit_interval and decided.numel() and not bool(((decided >= 0) & (decided <= 1)).all()):
        raise ValueError("expected local frequencies in [0, 1] but got values outside")
    return undecided


def calibrate_static_mask(local_frequency: torch.Tensor, alpha: float) -> torch.Tensor:
    """The ``round(alpha * L * H)`` most frequently local heads of all (decided) layers, ranked together.

    Args:
        local_frequency: ``[L, H]`` fraction of decode steps in which the oracle (at ``tau_static``) labelled
            each head local. A row entirely NaN marks a layer that is never decided (a sliding-window layer of a
            hybrid model): it is not ranked, does not count in ``L``, and its mask row is True.
        alpha: target fraction of local heads in ``[0, 1]`` (of the decided layers' heads).

    Returns:
        ``[L, H]`` bool mask, True = permanently local. Ties are broken by ``(layer, head)`` order.
    """
    undecided = check_local_frequency(local_frequency)
    L, H = local_frequency.shape
    decided = local_frequency[~undecided]  # the decided rows, in layer order: ties stay by (layer, head)
    count = static_local_count(alpha, decided.shape[0], H)
    order = torch.sort(decided.flatten().double(), descending=True, stable=True).indices
    picked = torch.zeros(decided.numel(), dtype=torch.bool, device=local_frequency.device)
    picked[order[:count]] = True
    mask = torch.ones(L, H, dtype=torch.bool, device=local_frequency.device)
    mask[~undecided] = picked.view(-1, H)
    return mask


def allocate_local_counts(local_frequency: torch.Tensor, sparsity: float, group_size: int = 1,
                          weight: float = 1.0) -> torch.Tensor:
    """Per-layer local counts for a budget rule: ``[L]`` long, how many heads (or KV groups) of each layer are local.

    The ``round(sparsity * L * H)`` most frequently local heads of all decided layers, ranked together
    (:func:`calibrate_static_mask`), counted per layer: a layer whose heads the calibration found often needing the
    bulk gets fewer local heads, one whose heads were mostly local gets more, and the mean over the decided layers
    is the target. Which heads are local at a step is left to the budget rule's score.

    With ``group_size = G > 1`` KV groups are counted: a group's frequency is the lowest of its ``G`` heads' (a group
    is local only when all its heads are), and the counts are of the ``H / G`` groups per layer. Undecided rows
    (NaN, a hybrid model's sliding layers) get every head (group); they are never used.

    ``weight = w < 1`` tempers the allocation towards the even spread: layer ``l`` gets the integer share (as
    :func:`~qada.criteria.budget.spread_count` rounds, so the total is kept) of ``w c_l + (1 - w) s H``, where
    ``c_l`` is the calibrated count above.

    Args:
        local_frequency: ``[L, H]`` oracle local frequencies (a static calibration).
        sparsity: the mean fraction of local heads (groups) over the decided layers, in ``[0, 1]``.
        group_size: query heads per KV head.
        weight: how far the calibration moves the counts from the even spread, in ``[0, 1]``.
    """
    L, H = local_frequency.shape
    if group_size < 1 or H % group_size:
        raise ValueError(f"expected a group size dividing the {H} heads but got {group_size}")
    check_threshold("weight", weight)
    frequency = local_frequency.reshape(L, H // group_size, group_size).amin(-1)
    counts = calibrate_static_mask(frequency, sparsity).sum(-1)
    if weight == 1.0:
        return counts
    decided = ~undecided_layers(frequency)
    target = weight * counts.double() + (1 - weight) * sparsity * (H // group_size)
    cumulative = torch.floor(torch.cumsum(torch.where(decided, target, 0.0), 0) + 0.5)
    shares = torch.diff(cumulative, prepend=cumulative.new_zeros(1)).long()
    return torch.where(decided, shares, counts)

