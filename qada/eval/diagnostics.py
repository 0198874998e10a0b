"""Decision-level diagnostics (issue 23): how each criterion's decisions and estimates compare with the oracle's,
measured on one decoding trajectory.

:class:`CriterionProbe` decides with a primary criterion (``dense`` in ``qada analyze``: the trajectory is the
model's own) and, at every decode step of every layer, also asks each probed criterion what it would decide and
what it estimates, next to the exact masses. :func:`decision_diagnostics` turns that into, per criterion and at the
oracle's threshold ``tau``:

* ``recall``: the fraction of the oracle's dense heads (``A_local / (A_local + A_bulk) < tau``, eq. 2) that the
  criterion also makes dense: a miss lets a head that needs the bulk read its window only;
* ``false_dense``: the fraction of the oracle's local heads that it makes dense (bytes read for nothing);
* ``log_error_dense``: median of ``log Â_bulk - log A_bulk`` on the oracle's dense heads (criteria that estimate the
  bulk mass; negative = underestimated, the failure that loses needles);
* ``exact_share_dense``: median share of ``A_bulk`` held by the exact set ``E`` on those heads (tail-aware criteria);
* ``sparsity``: the fraction of heads it makes local;
* ``kv_read``: the K/V its decisions would read as a fraction of dense attention's, its own reads to decide included
  (the run's ``kv_read``, :func:`~qada.attention.group_policy.kv_read`; a KV group reads its bulk unless all its
  heads are local), the mean over the recorded steps.

Only heads of rows with a bulk count (without one every head is trivially local).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qada.attention.group_policy import apply_group_policy, kv_read
from qada.criteria.base import HeadCriterion
from qada.criteria.budgeted import BudgetedQAdACriterion
from qada.criteria.compose import CompositeCriterion
from qada.criteria.tail import TailEstimate
from qada.criteria.threshold import ThresholdCriterion
from qada.step import DecodeStep

__all__ = ["CriterionProbe", "decision_diagnostics", "diagnostics_markdown"]


@dataclass(eq=False)
class CriterionProbe(CompositeCriterion):
    """Decides with ``primary``; records what every criterion of ``probes`` (name -> criterion) would decide.

    Each probe sees the same steps as a real run would (its prefill and append hooks are called), but its decisions
    change nothing. Reads the exact masses (O(T) per step) and copies to the host: an analysis tool.
    """

    primary: HeadCriterion
    probes: Mapping[str, HeadCriterion]
    records: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.probes:
            raise ValueError("expected at least one criterion to probe")
        for name, probe in self.probes.items():
            if not isinstance(probe, HeadCriterion):
                raise ValueError(f"expected probe {name!r} to be a HeadCriterion but got {type(probe).__name__}")

    def children(self) -> list[HeadCriterion]:
        return [self.primary, *self.probes.values()]

    @property
    def needs_full_scores(self) -> bool:  # type: ignore[override]
        return True

    def extra_reads(self, step: DecodeStep) -> torch.Tensor | None:
        return self.primary.extra_reads(step)  # the probes' reads change nothing: they only look

    def decide(self, step: DecodeStep) -> torch.Tensor:
        local = self.primary(step)
        keep = step.has_bulk.cpu().numpy()
        if not keep.any():
            return local

        def add(name: str, value: torch.Tensor) -> None:
            self.records.setdefault(name, []).append(value.detach().float().cpu().numpy()[keep])

        add("log_local", step.log_local)
        add("log_bulk", step.log_bulk)
        for name, probe in self.probes.items():
            decided = probe(step)
            add(f"{name}/local", decided)
            self.records.setdefault(f"{name}/kv_read", []).append(np.array([_kv_read(probe, step, decided)]))
            estimate = _estimate(probe, step)
            if estimate is not None:
                add(f"{name}/log_bulk", estimate)
            if isinstance(probe, TailEstimate):
                scores, valid = probe.exact_set(step)
                add(f"{name}/log_exact", torch.logsumexp(scores.masked_fill(~valid, float("-inf")), dim=-1))
        return local

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat arrays over every recorded (layer, step, row with a bulk, head)."""
        return {name: np.concatenate(parts).reshape(-1) for name, parts in self.records.items()}


def _kv_read(probe: HeadCriterion, step: DecodeStep, local: torch.Tensor) -> float:
    """The step's ``kv_read`` had ``probe`` decided ``local [b, H]`` (every row, as the run counts it)."""
    _, read = apply_group_policy(local, step.has_bulk, step.num_kv_heads)
    return float(kv_read(read, step.t_bulk + step.window.t_local, step.window.t_local, probe.extra_reads(step)))


def _estimate(probe: HeadCriterion, step: DecodeStep) -> torch.Tensor | None:
    """``[b, H]`` the probe's ``log Â_bulk``, if it estimates one: threshold criteria (the oracle's is exact, not
    an estimate), the tail-aware ones, and budgeted QAdA (eq. 7)."""
    if isinstance(probe, TailEstimate):
        return probe.tail_log_bulk(step)
    if isinstance(probe, ThresholdCriterion):
        return None if probe.needs_full_scores else probe.log_bulk(step)
    if isinstance(probe, BudgetedQAdACriterion):
        return step.log_bulk_estimate
    return None


def decision_diagnostics(arrays: Mapping[str, np.ndarray], tau: float) -> list[dict[str, Any]]:
    """One row per probed criterion (see the module docstring); ``None`` where there is nothing to measure."""
    if not 0 < tau <= 1:
        raise ValueError(f"expected tau in (0, 1] but got {tau!r}")
    log_local, log_bulk = arrays["log_local"], arrays["log_bulk"]
    oracle_dense = log_local - np.logaddexp(log_local, log_bulk) < math.log(tau)
    names = [key[: -len("/local")] for key in arrays if key.endswith("/local")]
    rows = []
    for name in names:
        dense = ~arrays[f"{name}/local"].astype(bool)
        row: dict[str, Any] = {
            "criterion": name,
            "heads": int(dense.size),
            "oracle_dense": int(oracle_dense.sum()),
            "sparsity": float(1 - dense.mean()) if dense.size else None,
            "recall": _mean(dense[oracle_dense]),
            "false_dense": _mean(dense[~oracle_dense]),
            "log_error_dense": None,
            "exact_share_dense": None,
            "kv_read": _mean(arrays[f"{name}/kv_read"]) if f"{name}/kv_read" in arrays else None,
        }
        if f"{name}/log_bulk" in arrays:
            error = arrays[f"{name}/log_bulk"][oracle_dense] - log_bulk[oracle_dense]
            row["log_error_dense"] = _median(error[np.isfinite(error)])
        if f"{name}/log_exact" in arrays:
            share = np.exp(arrays[f"{name}/log_exact"][oracle_dense] - log_bulk[oracle_dense])
            row["exact_share_dense"] = _median(share[np.isfinite(share)])
        rows.append(row)
    return rows


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if values.size else None


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values)) if values.size else None


def diagnostics_markdown(rows: list[dict[str, Any]], tau: float, command: str) -> str:
    """The rows of :func:`decision_diagnostics` as a markdown table."""
    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    columns = ["criterion", "heads", "oracle_dense", "sparsity", "kv_read", "recall", "false_dense",
               "log_error_dense", "exact_share_dense"]
    lines = [f"# Decision diagnostics against the oracle at tau {tau}", "", f"Command: `{command}`", "",
             "recall: share of the oracle's dense heads the criterion makes dense; false_dense: share of the "
             "oracle's local heads it makes dense; log_error_dense: median log(estimate / exact A_bulk) on the "
             "oracle's dense heads; exact_share_dense: median share of A_bulk in the exact set E there; kv_read: the "
             "K/V its decisions would read over dense attention's, its reads to decide included.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"
