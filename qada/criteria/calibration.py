"""Recording oracle frequencies for static calibration (paper App. A), as a mergeable accumulator."""

from __future__ import annotations

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

    Args:
        num_layers, num_heads: model size ``L, H``.
        tau_static: oracle threshold used while recording (default 0.6).
    """

    num_layers: int
    num_heads: int
    tau_static: float = 0.6
    local_counts: torch.Tensor = field(init=False)
    step_counts: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        check_threshold("tau_static", self.tau_static)
        if self.num_layers < 1 or self.num_heads < 1:
            raise ValueError(
                f"expected num_layers >= 1 and num_heads >= 1 but got {self.num_layers} and {self.num_heads}"
            )
        self.reset()

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
        if local.ndim != 2 or local.shape[1] != self.num_heads:
            raise ValueError(f"expected local of shape [batch, {self.num_heads}] but got {tuple(local.shape)}")
        self.local_counts[layer] += local.detach().to("cpu", torch.float64).sum(0)
        self.step_counts[layer] += local.shape[0]

    def merge(self, other: StaticCalibrator) -> None:
        """Add the counts of another calibrator (e.g. from another process)."""
        if (other.num_layers, other.num_heads, other.tau_static) != (
            self.num_layers,
            self.num_heads,
            self.tau_static,
        ):
            raise ValueError("can only merge calibrators with the same num_layers, num_heads and tau_static")
        self.local_counts += other.local_counts
        self.step_counts += other.step_counts

    def compute(self) -> torch.Tensor:
        """``[L, H]`` fraction of recorded steps in which each head was local."""
        if (self.step_counts == 0).any():
            missing = (self.step_counts[:, 0] == 0).nonzero().flatten().tolist()
            raise RuntimeError(f"no decode steps recorded for layer(s) {missing}")
        return (self.local_counts / self.step_counts).float()

    def static_criterion(self, alpha: float) -> StaticCriterion:
        """The static criterion with the ``round(alpha L H)`` most frequently local heads."""
        return StaticCriterion.from_frequency(self.compute(), alpha)
