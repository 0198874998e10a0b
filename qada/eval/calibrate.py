"""Calibration runs on prompts: static head masks (paper App. A, oracle local frequencies per head) and the
per-head correction of QAdA's lognormal estimate (``qada_calibrated``, recorded against the oracle's exact bulk
mass)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qada.artifacts import text_config
from qada.criteria import DenseCriterion, OracleCriterion, StaticCalibrator, StaticCriterion
from qada.eval.decode import decode_greedy, prefill
from qada.eval.evaluator import answer_budget
from qada.eval.tasks import Sample
from qada.functional import LogCorrection, fit_log_correction
from qada.models.apply import build_run, prepare_run
from qada.models.layer_types import layer_types
from qada.models.observers import DecisionEvent, Observer

__all__ = [
    "CalibrationObserver",
    "LogBulkRecorder",
    "LogBulkSamples",
    "calibrate_qada_correction",
    "calibrate_static",
    "collect_log_bulk_samples",
    "load_static_frequency",
    "save_qada_correction_fit",
    "save_static_frequency",
]


class CalibrationObserver(Observer):
    """Feeds every decode decision of the (oracle) criterion to a :class:`~qada.criteria.StaticCalibrator`."""

    def __init__(self, calibrator: StaticCalibrator) -> None:
        self.calibrator = calibrator

    def on_decision(self, event: DecisionEvent) -> None:
        self.calibrator.update(event.layer, event.local)


def calibrate_static(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Sample],
    tau_static: float = 0.6,
    decode_with_oracle: bool = True,
    window: dict | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """``[L, H]`` fraction of decode steps in which the oracle at ``tau_static`` labelled each head local.

    As in App. A: on RULER prompts (``decode_with_oracle=True``) the calibration run decodes with the
    oracle-approximated attention; otherwise it decodes densely while recording the oracle's labels.
    On a hybrid model the rows of the sliding-window layers are NaN: they pass through qada and are never decided
    (see :class:`~qada.criteria.StaticCalibrator`).
    """
    layers = layer_types(model)
    calibrator = StaticCalibrator(layers.num_layers, _num_heads(model), tau_static,
                                  layers.global_layers if layers.windows else None)
    observer = CalibrationObserver(calibrator)
    criterion = calibrator.criterion()
    if decode_with_oracle:
        run = build_run(criterion, "none", "sdpa", window, [observer])
    else:

        class _RecordOracle(Observer):
            wants_oracle = True

            def on_decision(self, event: DecisionEvent) -> None:
                from qada.functional import finite_threshold_decision

                local, _ = finite_threshold_decision(event.log_local, event.log_bulk, tau_static, event.t_bulk > 0)
                calibrator.update(event.layer, local)

        # the oracle's labels need the full scores only, not the lognormal estimate: no moment source to feed
        run = build_run(DenseCriterion(), "none", "sdpa", window, [_RecordOracle()])
    _decode_samples(model, tokenizer, samples, prepare_run(run, model, tokenizer), progress)
    return calibrator.compute()


def _num_heads(model: Any) -> int:
    return int(text_config(model.config).num_attention_heads)


def _decode_samples(model: Any, tokenizer: Any, samples: Sequence[Sample], run: Any, progress: bool) -> None:
    """Greedy decoding of every sample's answer with ``run`` attached (a prepared run)."""
    from tqdm.auto import tqdm

    eos = {tokenizer.eos_token_id} - {None}
    for sample in tqdm(samples, desc="qada calibrate", disable=not progress):
        ids = tokenizer(sample.input, return_tensors="pt", add_special_tokens=False)["input_ids"]
        prefilled = prefill(model, ids.to(model.device), run.criterion.prompt_queries())
        decode_greedy(model, prefilled, answer_budget(sample, tokenizer), eos, run)


@dataclass
class LogBulkSamples:
    """The exact and estimated bulk masses of every recorded decode decision, per layer and head.

    Attributes:
        estimate: ``[N, L, H]`` lognormal ``log Â_bulk`` (paper eq. 7).
        truth: ``[N, L, H]`` exact ``log A_bulk`` (the oracle's, from all scores).
        t_bulk: ``[N]`` bulk size of each sample (a decode step of one prompt row; shared by all layers).
    """

    estimate: torch.Tensor
    truth: torch.Tensor
    t_bulk: torch.Tensor

    @property
    def log_t_bulk(self) -> torch.Tensor:
        """``[N, 1, 1]`` ``log T_bulk`` (``-inf`` for samples without a bulk)."""
        return self.t_bulk.double().log()[:, None, None]

    def corrected(self, correction: LogCorrection | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``[N, L, H]`` the estimate after a correction ``(slope, offset, ...)`` (see ``qada_calibrated``)."""
        from qada.functional import apply_log_correction

        slope, offset = correction[0], correction[1]
        estimate = self.estimate.double()
        return apply_log_correction(estimate, estimate - self.log_t_bulk, slope.double(), offset.double())

    def abs_log_error(self, correction: LogCorrection | tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
        """Mean ``|log A_bulk - log Â_bulk|`` over the samples with a bulk, with or without a correction."""
        estimate = self.estimate.double() if correction is None else self.corrected(correction)
        error = (self.truth.double() - estimate).abs()
        keep = torch.isfinite(error)
        return float(error[keep].mean()) if keep.any() else math.nan


class LogBulkRecorder(Observer):
    """Keeps ``log A_bulk``, ``log Â_bulk`` and ``T_bulk`` of every decision of rows with a bulk (``wants_oracle``);
    :meth:`samples` stacks them to ``[N, L, H]``.

    Args:
        num_layers: model layers ``L``.
        global_layers: the layers that are decided (``None``: all); on a hybrid model the sliding-window layers are
            never decided, and their entries of :meth:`samples` are NaN (a fit gives them the identity).
    """

    wants_oracle = True

    def __init__(self, num_layers: int, global_layers: Sequence[int] | None = None) -> None:
        self.num_layers = num_layers
        self.global_layers = list(range(num_layers)) if global_layers is None else sorted(set(global_layers))
        if not self.global_layers:
            raise ValueError("expected at least one global layer to record but got none (every layer attends over "
                             "a sliding window and passes through qada untouched)")
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
            layer: [] for layer in self.global_layers}

    def on_decision(self, event: DecisionEvent) -> None:
        if event.log_bulk_estimate is None:
            raise RuntimeError("recording the lognormal estimate needs a moment source (e.g. moments='stored')")
        if event.layer not in self.rows:
            raise RuntimeError(f"expected decisions of the global layers {self.global_layers} but got layer "
                               f"{event.layer}")
        keep = (event.t_bulk > 0).cpu()
        self.rows[event.layer].append((event.log_bulk_estimate.detach().float().cpu()[keep],
                                       event.log_bulk.detach().float().cpu()[keep], event.t_bulk.cpu()[keep]))

    def samples(self) -> LogBulkSamples:
        counts = {layer: sum(len(r[2]) for r in rows) for layer, rows in self.rows.items()}
        first = self.global_layers[0]
        if len(set(counts.values())) != 1 or counts[first] == 0:
            raise RuntimeError(f"expected the same number (> 0) of recorded decode steps with a bulk in every "
                               f"{'global ' if len(self.global_layers) < self.num_layers else ''}layer but got "
                               f"{counts}")
        recorded = {layer: (torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]))
                    for layer, rows in self.rows.items()}
        N, H = recorded[first][0].shape
        missing = torch.full((N, H), float("nan"))  # a sliding-window layer: no samples
        estimate = torch.stack([recorded[layer][0] if layer in recorded else missing
                                for layer in range(self.num_layers)], 1)
        truth = torch.stack([recorded[layer][1] if layer in recorded else missing
                             for layer in range(self.num_layers)], 1)
        return LogBulkSamples(estimate, truth, torch.cat([r[2] for r in self.rows[first]]))


def collect_log_bulk_samples(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Sample],
    moments: Any = "stored",
    tau_static: float = 0.6,
    decode_with_oracle: bool = True,
    window: dict | None = None,
    progress: bool = True,
) -> LogBulkSamples:
    """Decode ``samples`` and record, per step, layer and head, the estimate ``log Â_bulk`` (from ``moments``) and
    the exact ``log A_bulk``.

    Decodes with the oracle at ``tau_static`` (``decode_with_oracle``, as :func:`calibrate_static` on RULER
    prompts) or densely; the moment source is prepared for the model first (a stored reference is built or loaded).
    On a hybrid model the sliding-window layers' entries are NaN (never decided).
    """
    if moments is None or moments == "none":
        raise ValueError("expected a moment source for the lognormal estimate but got moments: none")
    criterion = OracleCriterion(tau=tau_static) if decode_with_oracle else DenseCriterion()
    layers = layer_types(model)
    recorder = LogBulkRecorder(layers.num_layers, layers.global_layers)
    run = prepare_run(build_run(criterion, moments, "sdpa", window, [recorder]), model, tokenizer)
    _decode_samples(model, tokenizer, samples, run, progress)
    return recorder.samples()


def calibrate_qada_correction(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Sample],
    moments: Any = "stored",
    tau_static: float = 0.6,
    decode_with_oracle: bool = True,
    window: dict | None = None,
    ridge: float = 1.0,
    progress: bool = True,
    quantile: float | None = None,
) -> tuple[LogCorrection, LogBulkSamples]:
    """Fit the ``qada_calibrated`` correction (``slope, offset [L, H]``) on ``samples``: ``(correction, samples)``.

    See :func:`collect_log_bulk_samples` for the recording and :func:`qada.functional.fit_log_correction` for the
    fit (``ridge`` pulls each head toward the identity; ``quantile`` fits a conservative offset instead of the
    mean one). Evaluate it on prompts the fit never saw. On a hybrid model the sliding-window layers have no samples
    and get the identity (slope 1, offset 0, count 0).
    """
    recorded = collect_log_bulk_samples(model, tokenizer, samples, moments, tau_static, decode_with_oracle, window,
                                        progress)
    return fit_log_correction(recorded.estimate, recorded.truth, recorded.log_t_bulk, ridge, quantile), recorded


def save_qada_correction_fit(
    path: str | os.PathLike, correction: LogCorrection, model: Any, info: dict | None = None
) -> Path:
    """Save a fitted correction as a ``qada_correction`` artifact with the model's fingerprint (weights included);
    ``info`` records what it was fitted on (tasks, seeds, samples, moment source, tau_static, ...)."""
    from qada.artifacts import model_fingerprint, save_qada_correction

    return save_qada_correction(path, correction.slope, correction.offset, model_fingerprint(model.config, model),
                                count=correction.count, info=info)


def save_static_frequency(
    path: str | os.PathLike, frequency: torch.Tensor, model: Any, alpha: float, info: dict | None = None
) -> Path:
    """Save the calibrated frequencies and the static mask at ``alpha`` (safetensors, model fingerprint).

    A hybrid model's frequencies have NaN rows for its sliding-window layers (never decided); they are saved as
    NaN, and the mask makes ``round(alpha G H)`` of the ``G`` global layers' heads local (sliding rows True).
    """
    from qada.artifacts import model_fingerprint, save_artifact
    from qada.functional.static import check_local_frequency

    check_local_frequency(frequency, in_unit_interval=True)
    mask = StaticCriterion.from_frequency(frequency, alpha).mask
    return save_artifact(path, "head_mask", {"mask": mask, "frequency": frequency.float()},
                         model_fingerprint(model.config), info={"alpha": alpha, **(info or {})})


def load_static_frequency(path: str | os.PathLike, model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(frequency [L, H], mask [L, H])`` from :func:`save_static_frequency` (fingerprint checked with a model).

    Checked: ``frequency`` floating with each row in ``[0, 1]`` or entirely NaN (a hybrid model's sliding-window
    layer) and ``mask`` bool, both of the model's shape; with ``model`` also that every NaN row is a sliding-window
    layer of it. Raises :class:`~qada.artifacts.ArtifactError`.
    """
    from qada.artifacts import ArtifactError, load_artifact, model_fingerprint
    from qada.functional.static import check_local_frequency

    fingerprint = model_fingerprint(model.config) if model is not None else None
    tensors, info = load_artifact(path, "head_mask", required=("mask", "frequency"), fingerprint=fingerprint)
    frequency, mask = tensors["frequency"], tensors["mask"]
    L, H = info.model.get("num_layers"), info.model.get("num_heads")
    shape = tuple(frequency.shape)
    if (mask.dtype != torch.bool or tuple(mask.shape) != shape
            or (L is not None and H is not None and shape != (L, H))):
        raise ArtifactError(f"artifact {info.path!r} holds frequency {frequency.dtype} {list(frequency.shape)} and "
                            f"mask {mask.dtype} {list(mask.shape)}; expected a floating and a bool tensor of shape "
                            f"[{L}, {H}]")
    try:
        undecided = check_local_frequency(frequency, in_unit_interval=True)
    except ValueError as error:
        raise ArtifactError(f"artifact {info.path!r} holds broken frequencies: {error}") from None
    if model is not None and bool(undecided.any()) and hasattr(model, "modules"):
        layers = layer_types(model)
        wrong = [layer for layer in undecided.nonzero().flatten().tolist() if not layers.is_sliding(layer)]
        if wrong:
            raise ArtifactError(f"artifact {info.path!r} has no frequencies (NaN) for layer(s) {wrong}, which are "
                                f"global layers of this model ({layers.describe()}); it was calibrated for a model "
                                "with other sliding-window layers")
    return frequency, mask
