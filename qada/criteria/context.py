"""What a criterion sees for one decode step of one layer: the query, the cache, and lazily derived masses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from qada.functional import (
    bulk_count,
    bulk_mask,
    full_scores,
    gather_window,
    log_bulk_mass,
    log_local_mass,
    lognormal_score_moments,
)
from qada.functional.checks import check_float, check_ndim, group_size
from qada.functional.lognormal import lognormal_log_bulk_from_moments
from qada.moments.types import BulkMoments
from qada.window import Window

__all__ = ["StepContext"]


@dataclass(eq=False)
class StepContext:
    """One decode query per row and head against the cache of one layer.

    Everything costly is computed on first access and cached: the local-window scores always (O(T_local d)),
    the full scores only when a criterion asks for ``log_bulk`` (the oracle), the moments only when a criterion
    asks for ``log_bulk_estimate`` (QAdA).

    Attributes:
        query: ``[b, H, d]`` RoPE-rotated decode queries.
        keys: ``[b, H_kv, T, d]`` the layer's cache, the current token included.
        scale: attention scaling (the module's own, normally ``1/sqrt(d)``).
        window: the local window sizes.
        layer: layer index.
        step: decode step counter (for observers).
        start: ``[b]`` index of each row's first real token (left padding), ``None`` for no padding.
        moments: bulk key moments, or a zero-argument callable returning them (called at most once).
    """

    query: torch.Tensor
    keys: torch.Tensor
    scale: float
    window: Window = field(default_factory=Window)
    layer: int = 0
    step: int = 0
    start: torch.Tensor | None = None
    moments: BulkMoments | Callable[[], BulkMoments] | None = None
    fail_safe: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        check_float("query", self.query)
        check_float("keys", self.keys)
        check_ndim("query", self.query, 3, "[batch, heads, head_dim]")
        check_ndim("keys", self.keys, 4, "[batch, kv_heads, length, head_dim]")
        b, H, d = self.query.shape
        if self.keys.shape[0] != b or self.keys.shape[3] != d:
            raise ValueError(
                f"expected keys of shape [{b}, kv_heads, length, {d}] but got {tuple(self.keys.shape)}"
            )
        group_size(H, self.keys.shape[1])
        if self.start is not None:
            if self.start.shape != (b,):
                raise ValueError(f"expected start of shape [{b}] but got {tuple(self.start.shape)}")
            self.start = self.start.to(device=self.query.device, dtype=torch.long)

    # --- sizes -------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.query.shape[0]

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def length(self) -> int:
        """Cache length ``T`` (padding included)."""
        return self.keys.shape[2]

    @cached_property
    def _starts(self) -> torch.Tensor:
        if self.start is None:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.query.device)
        return self.start

    @cached_property
    def t_bulk(self) -> torch.Tensor:
        """``[b]`` bulk size of each row."""
        return bulk_count(self.length, self.window.t_local, self.window.t_sink, self._starts)

    @cached_property
    def has_bulk(self) -> torch.Tensor:
        """``[b]`` bool, False where the row has at most ``T_local`` real tokens."""
        return self.t_bulk > 0

    # --- local window ------------------------------------------------------------------------------------
    @cached_property
    def window_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [b, H_kv, W, d], valid [b, W])`` of the local window (see :func:`qada.functional.gather_window`)."""
        return gather_window(self.keys, self.window.t_local, self.window.t_sink, self.start)

    @cached_property
    def local_scores(self) -> torch.Tensor:
        """``[b, H, W]`` float32 scores of the local window."""
        return full_scores(self.query, self.window_keys[0], self.scale)

    @cached_property
    def log_local(self) -> torch.Tensor:
        """``[b, H]`` ``log A_local``."""
        return log_local_mass(self.local_scores, self.window_keys[1])

    # --- exact bulk (oracle) -----------------------------------------------------------------------------
    @cached_property
    def scores(self) -> torch.Tensor:
        """``[b, H, T]`` float32 scores over the whole cache (O(T d)): only the oracle asks for them."""
        return full_scores(self.query, self.keys, self.scale)

    @cached_property
    def bulk_mask(self) -> torch.Tensor:
        """``[b, T]`` bool, True on each row's bulk."""
        return bulk_mask(self.length, self.window.t_local, self.window.t_sink, self._starts)

    @cached_property
    def log_bulk(self) -> torch.Tensor:
        """``[b, H]`` exact ``log A_bulk`` (``-inf`` without a bulk)."""
        return log_bulk_mass(self.scores, self.bulk_mask)

    # --- lognormal estimate (QAdA) -----------------------------------------------------------------------
    @cached_property
    def bulk_moments(self) -> BulkMoments:
        if self.moments is None:
            raise RuntimeError("this step has no moment source: a criterion that needs moments needs one")
        return self.moments() if callable(self.moments) else self.moments

    @cached_property
    def score_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu_s, sigma_s^2)``, each ``[b, H]``: mean and variance of the bulk scores under the moments (eqs. 5-6)."""
        mean, cov = self.bulk_moments
        return lognormal_score_moments(self.query, mean, cov, self.scale)

    @cached_property
    def log_bulk_estimate(self) -> torch.Tensor:
        """``[b, H]`` lognormal estimate ``log T_bulk + mu_s + sigma_s^2/2`` (paper eq. 7)."""
        mu_s, var_s = self.score_moments
        return lognormal_log_bulk_from_moments(mu_s, var_s, self.t_bulk)

    # --- bookkeeping -------------------------------------------------------------------------------------
    def note_fail_safe(self, forced_dense: torch.Tensor) -> None:
        """Count heads forced dense because an estimate was NaN/inf (kept on the device, no sync)."""
        count = forced_dense.sum()
        self.fail_safe = count if self.fail_safe is None else self.fail_safe + count
