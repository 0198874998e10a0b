"""The paper's analyses from one recorded decoding run: log-error table (Table 2), head maps (Fig. 7), sparsity
vs tau (Fig. 6b), per-token sparsity (Fig. 6a) and head types (Fig. 2, middle).

Recording: decode with any criterion while :class:`DecisionLog` (an observer with ``wants_oracle``) keeps, for
every (layer, step, row, head), ``log A_local``, the exact ``log A_bulk``, the lognormal estimate and the score
moments ``mu_s, sigma_s^2`` behind it. Because the oracle and QAdA decisions at *any* tau are functions of these
numbers, one recording gives every threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from qada.models.observers import DecisionEvent, Observer

__all__ = [
    "DecisionLog",
    "analysis_markdown",
    "gaussian_control_log_bulk",
    "head_local_frequency",
    "head_types",
    "log_error_table",
    "per_step_sparsity",
    "sparsity_vs_tau",
]


@dataclass
class DecisionLog(Observer):
    """Keeps the masses of every decode decision as arrays ``[records, H]`` (one record per layer, step and row)."""

    wants_oracle = True
    rows: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def on_decision(self, event: DecisionEvent) -> None:
        if event.log_bulk_estimate is None:
            raise RuntimeError("DecisionLog needs a moment source: enable qada with moments (e.g. 'current')")
        b, H = event.local.shape
        fields = {
            "log_local": event.log_local, "log_bulk": event.log_bulk, "estimate": event.log_bulk_estimate,
            "score_mean": event.score_mean, "score_var": event.score_var, "local": event.local,
        }
        for name, value in fields.items():
            self.rows.setdefault(name, []).append(value.detach().float().cpu().numpy())
        self.rows.setdefault("t_bulk", []).append(np.repeat(event.t_bulk.cpu().numpy()[:, None], H, axis=1))
        self.rows.setdefault("layer", []).append(np.full((b, H), event.layer))
        self.rows.setdefault("step", []).append(np.full((b, H), event.step))
        self.rows.setdefault("sequence", []).append(np.full((b, H), self.sequence) + np.arange(b)[:, None])
        self.rows.setdefault("head", []).append(np.broadcast_to(np.arange(H), (b, H)).copy())

    sequence: int = 0

    def next_sequence(self, batch: int = 1) -> None:
        """Call between prompts so per-token curves keep prompts apart."""
        self.sequence += batch

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat arrays over all recorded (layer, step, row, head) with a bulk."""
        flat = {k: np.concatenate(v).reshape(-1) for k, v in self.rows.items()}
        keep = flat["t_bulk"] > 0
        return {k: v[keep] for k, v in flat.items()}


def _log_ratio(log_local: np.ndarray, log_bulk: np.ndarray) -> np.ndarray:
    return log_local - np.logaddexp(log_local, log_bulk)


def sparsity_vs_tau(arrays: dict[str, np.ndarray], taus) -> dict[str, list[float]]:
    """Fraction of (layer, step, head) decisions that are local at each tau, for the oracle and QAdA (Fig. 6b)."""
    oracle = _log_ratio(arrays["log_local"], arrays["log_bulk"])
    qada = _log_ratio(arrays["log_local"], arrays["estimate"])
    out = {"tau": list(taus), "oracle": [], "qada": []}
    for tau in taus:
        threshold = math.log(tau) if tau > 0 else -math.inf
        out["oracle"].append(float((oracle >= threshold).mean()))
        out["qada"].append(float((np.isfinite(qada) & (qada >= threshold)).mean()))
    return out


def per_step_sparsity(arrays: dict[str, np.ndarray], tau: float) -> dict[str, list[float]]:
    """Mean sparsity per decode step (over layers, heads and prompts) for oracle and QAdA (Fig. 6a)."""
    steps = np.unique(arrays["step"])
    threshold = math.log(tau)
    oracle = _log_ratio(arrays["log_local"], arrays["log_bulk"]) >= threshold
    qada = _log_ratio(arrays["log_local"], arrays["estimate"]) >= threshold
    return {
        "step": steps.tolist(),
        "oracle": [float(oracle[arrays["step"] == s].mean()) for s in steps],
        "qada": [float(qada[arrays["step"] == s].mean()) for s in steps],
    }


def head_local_frequency(arrays: dict[str, np.ndarray], tau: float, num_layers: int, num_heads: int):
    """``[L, H]`` fraction of steps each head is local, for the oracle and for QAdA (Fig. 7 shows 1 - this)."""
    threshold = math.log(tau)
    out = {}
    for name, log_bulk in (("oracle", arrays["log_bulk"]), ("qada", arrays["estimate"])):
        local = _log_ratio(arrays["log_local"], log_bulk) >= threshold
        total = np.zeros((num_layers, num_heads))
        count = np.zeros((num_layers, num_heads))
        np.add.at(total, (arrays["layer"], arrays["head"]), local)
        np.add.at(count, (arrays["layer"], arrays["head"]), 1)
        out[name] = np.divide(total, count, out=np.full_like(total, np.nan), where=count > 0)
    return out


def head_types(frequency: np.ndarray, low: float = 0.1, high: float = 0.9) -> dict[str, float]:
    """Fractions of heads that are consistently local (freq >= high), often long-context (<= low), or varying."""
    valid = frequency[np.isfinite(frequency)]
    return {
        "consistently_local": float((valid >= high).mean()),
        "varying": float(((valid > low) & (valid < high)).mean()),
        "often_long_context": float((valid <= low).mean()),
    }


def gaussian_control_log_bulk(arrays: dict[str, np.ndarray], seed: int = 0, max_records: int = 20000) -> np.ndarray:
    """``log A_bulk`` if the bulk keys were i.i.d. Gaussian with the recorded moments (Table 2's control row).

    For ``k ~ N(mu_K, Sigma_K)`` the scores are ``N(mu_s, sigma_s^2)``, so sampling ``T_bulk`` scores per record
    is exact in distribution and avoids sampling ``d``-dimensional keys. Uses at most ``max_records`` records.
    """
    generator = torch.Generator().manual_seed(seed)
    n = min(len(arrays["t_bulk"]), max_records)
    out = np.empty(n)
    for i in range(n):
        t = int(arrays["t_bulk"][i])
        scores = torch.randn(t, generator=generator, dtype=torch.float64) * math.sqrt(max(arrays["score_var"][i], 0.0))
        out[i] = float(torch.logsumexp(scores + float(arrays["score_mean"][i]), 0))
    return out


def log_error_table(arrays: dict[str, np.ndarray], seed: int = 0, max_control: int = 20000) -> list[dict]:
    """Table 2: mean ``|log A_bulk - log Â_bulk|`` and ``|log A_bulk - log A_local|`` for all heads and for the
    20% / 10% most local (by oracle ratio) head-steps, plus the i.i.d.-Gaussian control row."""
    err_est = np.abs(arrays["log_bulk"] - arrays["estimate"])
    err_local = np.abs(arrays["log_bulk"] - arrays["log_local"])
    ratio = _log_ratio(arrays["log_local"], arrays["log_bulk"])
    rows = []
    for name, fraction in (("all heads", 1.0), ("top 20% local", 0.2), ("top 10% local", 0.1)):
        cut = np.quantile(ratio, 1 - fraction) if fraction < 1 else -np.inf
        keep = ratio >= cut
        rows.append({"selection": name, "n": int(keep.sum()),
                     "abs_log_error_lognormal": float(np.nanmean(err_est[keep])),
                     "abs_log_gap_bulk_vs_local": float(np.nanmean(err_local[keep]))})
    control = gaussian_control_log_bulk(arrays, seed, max_control)
    n = len(control)
    rows.append({"selection": "i.i.d. Gaussian control", "n": n,
                 "abs_log_error_lognormal": float(np.mean(np.abs(control - arrays["estimate"][:n]))),
                 "abs_log_gap_bulk_vs_local": float(np.mean(np.abs(control - arrays["log_local"][:n])))})
    return rows


def analysis_markdown(command: str, records: int, table: list[dict], types: dict[str, dict], tau: float) -> str:
    """The Table-2 rows and the head types as markdown, headed by the command that produced them."""
    md = [f"Produced by `{command}` ({records} layer-step-head records).", "",
          "| selection | n | mean abs(log A_bulk - lognormal estimate) | mean abs(log A_bulk - log A_local) |",
          "|---|---:|---:|---:|"]
    md += [f"| {r['selection']} | {r['n']} | {r['abs_log_error_lognormal']:.3f} | "
           f"{r['abs_log_gap_bulk_vs_local']:.3f} |" for r in table]
    md += ["", f"| head types at tau {tau} | consistently local | varying | often long-context |",
           "|---|---:|---:|---:|"]
    md += [f"| {name} | {t['consistently_local']:.2f} | {t['varying']:.2f} | {t['often_long_context']:.2f} |"
           for name, t in types.items()]
    return "\n".join(md) + "\n"
