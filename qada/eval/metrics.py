"""torchmetrics metrics of a criterion configuration: task score, sparsity, and agreement with the oracle."""

from __future__ import annotations

import torch

from qada.eval._extra import eval_extra_error

try:
    from torchmetrics import MeanMetric, Metric, MetricCollection
    from torchmetrics.classification import BinaryStatScores
except ModuleNotFoundError as error:
    raise eval_extra_error(error, "torchmetrics") from error

from qada.functional import finite_threshold_decision
from qada.models.observers import DecisionEvent, Observer

__all__ = ["ConfigMetrics", "OracleAgreement", "agreement_summary"]


class ConfigMetrics(MetricCollection):
    """Per-configuration means over samples: ``score`` (0-100), ``sparsity``, ``kv_sparsity`` (global layers) and
    the same two over all layers (``*_all_layers``, sliding-window layers counted as local), ``kv_read``; plus
    ``oracle`` stat scores (local = positive) when the oracle is recorded alongside. Synced across processes by
    torchmetrics.
    """

    def __init__(self) -> None:
        super().__init__(
            {
                "score": MeanMetric(),
                "sparsity": MeanMetric(),
                "kv_sparsity": MeanMetric(),
                "sparsity_all_layers": MeanMetric(),
                "kv_sparsity_all_layers": MeanMetric(),
                "kv_read": MeanMetric(),
                "oracle": BinaryStatScores(),
            },
            compute_groups=False,
        )


def agreement_summary(stats: torch.Tensor) -> dict[str, float | None]:
    """Agreement, precision and recall of the local and long-context labels from ``[tp, fp, tn, fn, support]``."""
    tp, fp, tn, fn = (float(x) for x in stats[:4])
    total = tp + fp + tn + fn
    if total == 0:
        return {}

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return {
        "agreement": (tp + tn) / total,
        "local_precision": ratio(tp, tp + fp),
        "local_recall": ratio(tp, tp + fn),
        "long_precision": ratio(tn, tn + fn),
        "long_recall": ratio(tn, tn + fp),
        "oracle_sparsity": (tp + fn) / total,
    }


class OracleAgreement(Observer):
    """Compares every decision with the oracle at ``tau`` on the same query (needs the full scores: O(T)).

    Args:
        metric: a ``BinaryStatScores`` (preds = the criterion's local mask, target = the oracle's).
        tau: the oracle threshold.
    """

    wants_oracle = True

    def __init__(self, metric: Metric, tau: float = 0.6) -> None:
        self.metric = metric
        self.tau = tau

    def on_decision(self, event: DecisionEvent) -> None:
        oracle, _ = finite_threshold_decision(event.log_local, event.log_bulk, self.tau, event.t_bulk > 0)
        self.metric.update(event.local.flatten().long(), oracle.flatten().long())
