"""Hybrid: heads that calibration finds (almost) always full stay dense; a query-adaptive criterion decides the rest."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from qada.artifacts import load_artifact
from qada.criteria.base import HeadCriterion, register_criterion
from qada.criteria.compose import CompositeCriterion, _build
from qada.functional import calibrate_static_mask, check_threshold
from qada.step import DecodeStep

__all__ = ["HybridCriterion", "load_always_dense", "load_local_frequency"]


def _default_base() -> dict[str, Any]:
    return {"name": "qada", "tau": 0.6}


def _as_head_mask(value: Any) -> torch.Tensor:
    """An ``[L, H]`` bool tensor from a tensor or nested lists of bools (or 0/1)."""
    if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__"):
        raise ValueError(
            f"expected dense_mask as a [layers, heads] grid of booleans but got the path {str(value)!r}; "
            "give a calibration artifact as calibration=PATH (with dense_fraction) instead"
        )
    try:
        mask = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"expected dense_mask as a [layers, heads] grid of booleans ({error})") from None
    if mask.ndim != 2:
        raise ValueError(f"expected dense_mask of shape [layers, heads] but got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("expected dense_mask of booleans (or 0/1) but got other values")
        mask = mask.bool()
    return mask.cpu()


def load_local_frequency(path: str | os.PathLike) -> torch.Tensor:
    """The ``[L, H]`` oracle local frequencies of a static calibration artifact (``qada calibrate``: a ``head_mask``
    file holding a ``frequency`` tensor), checked (a hybrid model's sliding layers are NaN rows). The model
    fingerprint is checked later, by shape, in the criterion's ``check_model``."""
    from qada.functional.static import check_local_frequency

    tensors, info = load_artifact(path, "head_mask", required=("frequency",))
    frequency = tensors["frequency"]
    if frequency.ndim != 2 or not frequency.dtype.is_floating_point:
        raise ValueError(
            f"artifact {info.path!r} holds frequencies {frequency.dtype} {list(frequency.shape)}; "
            "expected a floating [layers, heads] tensor"
        )
    try:
        check_local_frequency(frequency)
    except ValueError as error:
        raise ValueError(f"artifact {info.path!r} holds broken frequencies: {error}") from None
    return frequency


def load_always_dense(path: str | os.PathLike, dense_fraction: float) -> torch.Tensor:
    """``[L, H]`` bool: the ``round(dense_fraction L H)`` heads of a static calibration artifact
    (:func:`load_local_frequency`) with the lowest oracle local frequency, ties by ``(layer, head)`` order.

    A hybrid model's artifact has NaN rows for its sliding-window layers (never decided): only the ``G`` global
    layers are ranked (``round(dense_fraction G H)`` heads) and the sliding rows are False (those layers pass through
    qada untouched).
    """
    from qada.functional.static import undecided_layers

    frequency = load_local_frequency(path)
    # the lowest frequencies ranked first; a stable sort keeps ties in (layer, head) order
    always_dense = calibrate_static_mask(-frequency.double(), dense_fraction).cpu()
    always_dense[undecided_layers(frequency).cpu()] = False
    return always_dense


@register_criterion("hybrid")
@dataclass
class HybridCriterion(CompositeCriterion):
    """Always-dense heads from calibration; ``base`` (e.g. QAdA) decides the other heads per query.

    .. math:: \\text{local}[r, h] = \\text{base}(\\text{step})[r, h] \\wedge \\neg\\,\\text{always\\_dense}[l, h]

    Equal to ``all_of([{name: static, mask: ~always_dense}, base])``. The always-dense set is given directly
    (``dense_mask``) or read from a static calibration artifact (``calibration``): the ``dense_fraction`` of all
    heads with the lowest oracle local frequency (ties by layer, then head, as in
    :func:`qada.functional.calibrate_static_mask`). A layer whose heads are all always dense does not run
    ``base`` at all. With a budgeted base (``qada_budget``) the budget counts every head of the row, so the
    hybrid's sparsity is at most the base's.

    Args:
        base: the adaptive criterion (instance, name or config), default ``{"name": "qada", "tau": 0.6}``.
        dense_mask: ``[L, H]`` bool tensor or nested lists, True = always dense; or None with ``calibration``.
        calibration: path of a static calibration artifact (``qada calibrate``, with oracle frequencies).
        dense_fraction: with ``calibration``, the fraction of all heads made always dense, in ``[0, 1]``.

    Attributes:
        always_dense: ``[L, H]`` bool, True = always dense (``dense_mask``, or derived from ``calibration``).
    """

    base: Any = field(default_factory=_default_base)
    dense_mask: Any = None
    calibration: str | None = None
    dense_fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.dense_mask is None) == (self.calibration is None):
            raise ValueError(
                "expected exactly one of dense_mask (an [L, H] grid, True = always dense) and calibration "
                f"(a static calibration artifact, with dense_fraction) but got "
                f"{'both' if self.dense_mask is not None else 'neither'}"
            )
        if self.dense_mask is not None:
            if self.dense_fraction is not None:
                raise ValueError(
                    f"expected dense_fraction only with calibration but got dense_fraction={self.dense_fraction!r} "
                    "with dense_mask"
                )
            self.dense_mask = _as_head_mask(self.dense_mask)
            always_dense = self.dense_mask
        else:
            if not isinstance(self.calibration, (str, os.PathLike)):
                raise ValueError(f"expected calibration to be a path but got {self.calibration!r}")
            if self.dense_fraction is None:
                raise ValueError("expected dense_fraction in [0, 1] with calibration but got None")
            check_threshold("dense_fraction", self.dense_fraction)
            self.calibration = os.fspath(self.calibration)
            always_dense = load_always_dense(self.calibration, self.dense_fraction)
        self.base = _build(self.base)
        self._check_depth()
        self.always_dense = always_dense

    def children(self) -> list[HeadCriterion]:
        return [self.base]

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return True  # the always-dense set is calibrated, like a static mask

    def check_model(self, num_layers: int, num_heads: int) -> None:
        if tuple(self.always_dense.shape) != (num_layers, num_heads):
            what = f"calibration {self.calibration!r}" if self.calibration is not None else "dense_mask"
            raise ValueError(
                f"expected the hybrid's {what} of shape [{num_layers}, {num_heads}] for this model but got "
                f"{list(self.always_dense.shape)}"
            )
        super().check_model(num_layers, num_heads)

    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """``keep``: ``[H]`` bool, the heads of ``layer`` the base may make local (not always dense)."""
        L, H = self.always_dense.shape
        if not 0 <= layer < L:
            raise ValueError(f"hybrid always-dense mask of shape [{L}, {H}] does not fit layer {layer}")
        return {"keep": ~self.always_dense[layer]}

    def decide(self, step: DecodeStep) -> torch.Tensor:
        keep = self.state(step)["keep"]
        if keep.shape[0] != step.num_heads:
            raise ValueError(f"hybrid always-dense mask of {keep.shape[0]} heads does not fit a step with "
                             f"{step.num_heads} heads")
        return self.base(step) & keep
