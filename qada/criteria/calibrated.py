"""Calibrated QAdA: the QAdA test with a per-head affine correction of the lognormal estimate (paper eq. 7)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from qada.criteria.base import register_criterion
from qada.criteria.threshold import ThresholdCriterion
from qada.functional import apply_log_correction
from qada.step import DecodeStep

__all__ = ["CalibratedQAdACriterion"]


def _grid(name: str, value: Any) -> torch.Tensor:
    """An ``[L, H]`` finite float32 tensor from a tensor or nested lists."""
    try:
        grid = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"expected {name} as a [layers, heads] grid of numbers ({error})") from None
    if grid.ndim != 2:
        raise ValueError(f"expected {name} of shape [layers, heads] but got shape {tuple(grid.shape)}")
    if not torch.isfinite(grid).all():
        raise ValueError(f"expected finite {name} but got NaN or inf")
    return grid.cpu()


@register_criterion("qada_calibrated")
@dataclass
class CalibratedQAdACriterion(ThresholdCriterion):
    """QAdA with a per-head correction of the lognormal estimate, fitted against the oracle's exact bulk mass.

    Local when ``A_local / (A_local + Â'_bulk) >= tau`` with (see :mod:`qada.functional.correction`)

    .. math:: \\log \\hat A'_\\text{bulk} = \\log T_\\text{bulk} + a_{lh}\\,(\\mu_s + \\sigma_s^2/2) + b_{lh}

    i.e. eq. 7's per-key term ``mu_s + sigma_s^2/2`` scaled by ``slope[l, h]`` and shifted by ``offset[l, h]``;
    the ``log T_bulk`` term is kept, so a correction fitted at one prompt length carries to others. The identity
    (``slope = 1, offset = 0``) decides exactly as ``qada``; a NaN/inf estimate makes the head dense and is
    counted in ``step.fail_safe``. A correction fitted on a hybrid model has the identity in its sliding-window
    layers' rows (never decided, never used).

    Args:
        tau: threshold in ``[0, 1]``; higher means fewer local heads.
        correction: path of a ``qada_correction`` artifact (``qada calibrate --correction``), or ``None`` with
            ``slope`` and ``offset``. Its shapes are checked here and against the model in :meth:`check_model`;
            :func:`qada.artifacts.load_qada_correction` also checks the model fingerprint.
        slope, offset: ``[L, H]`` nested lists or tensors (finite), instead of ``correction``.
    """


    correction: str | os.PathLike | None = None
    slope: Any = None
    offset: Any = None
    needs_moments = True
    needs_calibration = True

    def __post_init__(self) -> None:
        super().__post_init__()
        inline = self.slope is not None or self.offset is not None
        if self.correction is not None:
            if inline:
                raise ValueError("expected either a correction artifact (correction=PATH) or inline slope and "
                                 "offset, not both")
            if not isinstance(self.correction, (str, os.PathLike)):
                raise ValueError(f"expected correction to be the path of a correction artifact but got "
                                 f"{type(self.correction).__name__}")
            from qada.artifacts import load_qada_correction

            slope, offset, _ = load_qada_correction(self.correction)
        elif self.slope is None or self.offset is None:
            raise ValueError("expected a correction artifact (correction=PATH, from `qada calibrate --correction`) "
                             "or inline slope and offset ([layers, heads] grids) but got "
                             f"{'only slope' if self.slope is not None else 'only offset' if inline else 'neither'}")
        else:
            slope, offset = _grid("slope", self.slope), _grid("offset", self.offset)
            if slope.shape != offset.shape:
                raise ValueError(f"expected slope and offset of one shape but got {list(slope.shape)} and "
                                 f"{list(offset.shape)}")
        self._slope, self._offset = slope.float(), offset.float()

    @property
    def correction_shape(self) -> tuple[int, int]:
        """``(L, H)`` of the correction."""
        return tuple(self._slope.shape)

    def check_model(self, num_layers: int, num_heads: int) -> None:
        if self.correction_shape != (num_layers, num_heads):
            raise ValueError(f"expected a correction of shape [{num_layers}, {num_heads}] for this model but got "
                             f"{list(self.correction_shape)}")

    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """``slope`` and ``offset``: ``[H]`` float64, the layer's correction."""
        L, H = self.correction_shape
        if not 0 <= layer < L:
            raise ValueError(f"correction of shape [{L}, {H}] does not fit layer {layer}")
        return {"slope": self._slope[layer].double(), "offset": self._offset[layer].double()}

    def log_bulk(self, step: DecodeStep) -> torch.Tensor:
        state = self.state(step)
        if state["slope"].shape[0] != step.num_heads:
            raise ValueError(f"correction of {state['slope'].shape[0]} heads does not fit a step with "
                             f"{step.num_heads} heads")
        estimate = step.log_bulk_estimate
        slope, offset = state["slope"].to(estimate.dtype), state["offset"].to(estimate.dtype)
        return apply_log_correction(estimate, step.log_mean_exp_bulk, slope, offset)
