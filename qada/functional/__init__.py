"""Pure math of qada: tensors in, tensors out, batched over ``[batch, heads]``, accumulated in float32+."""

from qada.functional.correction import LogCorrection, apply_log_correction, fit_log_correction
from qada.functional.decisions import check_threshold, finite_threshold_decision, local_ratio, log_local_ratio
from qada.functional.lognormal import (
    lognormal_log_bulk_from_moments,
    lognormal_log_bulk_mass,
    lognormal_score_moments,
)
from qada.functional.masses import full_scores, log_bulk_mass, log_local_mass, window_attention
from qada.functional.static import calibrate_static_mask, static_local_count
from qada.functional.window import bulk_count, bulk_mask, gather_window, local_index_set, window_indices

__all__ = [
    "LogCorrection",
    "apply_log_correction",
    "bulk_count",
    "bulk_mask",
    "calibrate_static_mask",
    "check_threshold",
    "finite_threshold_decision",
    "fit_log_correction",
    "gather_window",
    "full_scores",
    "local_index_set",
    "log_bulk_mass",
    "log_local_mass",
    "local_ratio",
    "log_local_ratio",
    "lognormal_log_bulk_from_moments",
    "lognormal_log_bulk_mass",
    "lognormal_score_moments",
    "static_local_count",
    "window_attention",
    "window_indices",
]
