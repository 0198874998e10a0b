"""Recording oracle frequencies for static calibration (paper App. A), as a mergeable accumulator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qada.criteria.oracle import OracleCriterion
from qada.criteria.static import StaticCriterion
from qada.functional import check_threshold

__all__ = ["StaticCalibrator"]


@dataclass
class StaticCalibrator:
    """Counts, for every ``(layer, head)``, the decode steps in which the oracle at ``tau_static`` said local.

    Use :meth:`criterion` to get the oracle to decode with (on RULER prompts the paper's calibration run
    decodes with the oracle-approximated attention), feed its decisions to :meth:`update`, then
    :meth:`static_criterion` gives the static mask for a sparsity ``alpha``.

    On a hybrid model only the global layers are decided (sliding-window layers pass through qada untouched):
    give them as ``global_layers``. The other layers then get NaN frequencies in :meth:`compute` (not ranked;
    ``alpha`` is the fraction of the global heads made local; their static mask rows are True, never used).

    Args:
        num_layers, num_heads: model size ``L, H``.
        tau_static: oracle threshold used while recording (default 0.6).
        global_layers: the layers that are decided (``None``: all of them), e.g.
            ``qada.models.layer_types.layer_types(model).global_layers``.
    """

    num_layers: int
    num_heads: int
    tau_static: float = 0.6
    global_layers: Sequence[int] | None = None
    local_counts: torch.Tensor = field(init=False)
    step_counts: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        check_threshold("tau_static", self.tau_static)
        if self.num_layers < 1 or self.num_heads < 1:
            raise ValueError(
                f"expected num_layers >= 1 and num_heads >= 1 but got {self.num_layers} and {self.num_heads}"
            )
        if self.global_layers is not None:
            layers = sorted(set(self.global_layers))
            if any(isinstance(x, bool) or not isinstance(x, int) for x in layers) or (
                    layers and not 0 <= layers[0] <= layers[-1] < self.num_layers):
                raise ValueError(f"expected global_layers as layer indices in [0, {self.num_layers}) but got "
                                 f"{list(self.global_layers)}")
            if not layers:
                raise ValueError("expected at least one global layer to calibrate but got none (every layer "
                                 "attends over a sliding window and passes through qada untouched)")
            self.global_layers = layers
        self.reset()

    @property
    def decided_layers(self) -> list[int]:
        """The layers whose decisions are recorded (``global_layers``, or every layer)."""
        return list(range(self.num_layers)) if self.global_layers is None else list(self.global_layers)

    def criterion(self) -> OracleCriterion:
        """The oracle at ``tau_static`` whose decisions this calibrator records."""
        return OracleCriterion(tau=self.tau_static)

    def reset(self) -> None:
        self.local_counts = torch.zeros(self.num_layers, self.num_heads, dtype=torch.float64)
        self.step_counts = torch.zeros(self.num_layers, 1, dtype=torch.float64)

    def update(self, layer: int, local: torch.Tensor) -> None:
        """Add one decode step of ``layer``: ``local [b, H]`` bool oracle decisions (each row counts once)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"expected a layer in [0, {self.num_layers}) but got {layer}")
        if self.global_layers is not None and layer not in self.global_layers:
            raise ValueError(f"expected a decision of a global layer {self.global_layers} but got layer {layer} "
                             "(a sliding-window layer is never decided)")
        if local.ndim != 2 or local.shape[1] != self.num_heads:
            raise ValueError(f"expected local of shape [batch, {self.num_heads}] but got {tuple(local.shape)}")
        self.local_counts[layer] += local.detach().to("cpu", torch.float64).sum(0)
        self.step_counts[layer] += local.shape[0]

    def merge(self, other: StaticCalibrator) -> None:
        """Add the counts of another calibrator (e.g. from another process)."""
        if (other.num_layers, other.num_heads, other.tau_static, other.global_layers) != (
            self.num_layers,
            self.num_heads,
            self.tau_static,
            self.global_layers,
        ):
            raise ValueError("can only merge calibrators with the same num_layers, num_heads, tau_static and "
                             "global_layers")
        self.local_counts += other.local_counts
        self.step_counts += other.step_counts

    def compute(self) -> torch.Tensor:
        """``[L, H]`` fraction of recorded steps in which each head was local (NaN rows: layers not in
        ``global_layers``, never decided)."""
        decided = self.decided_layers
        missing = [layer for layer in decided if self.step_counts[layer, 0] == 0]
        if missing:
            raise RuntimeError(f"no decode steps recorded for layer(s) {missing}")
        frequency = torch.full((self.num_layers, self.num_heads), float("nan"), dtype=torch.float64)
        frequency[decided] = self.local_counts[decided] / self.step_counts[decided]
        return frequency.float()

    def static_criterion(self, alpha: float) -> StaticCriterion:
        """The static criterion with the ``round(alpha G H)`` most frequently local heads of the ``G`` global
        layers (``G = L`` unless ``global_layers`` is given)."""
        return StaticCriterion.from_frequency(self.compute(), alpha)
