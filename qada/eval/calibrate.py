"""Static calibration (paper App. A): oracle local frequencies per head, recorded while decoding prompts."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qada.criteria import StaticCalibrator, StaticCriterion
from qada.eval.decode import decode_greedy, prefill
from qada.eval.evaluator import answer_budget
from qada.eval.tasks import Sample
from qada.models.apply import build_run
from qada.models.observers import DecisionEvent, Observer

__all__ = ["CalibrationObserver", "calibrate_static", "load_static_frequency", "save_static_frequency"]


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
    """
    from tqdm.auto import tqdm

    config = model.config
    calibrator = StaticCalibrator(config.num_hidden_layers, config.num_attention_heads, tau_static)
    observer = CalibrationObserver(calibrator)
    criterion = calibrator.criterion()
    if decode_with_oracle:
        run = build_run(criterion, None, "sdpa", window, [observer])
    else:
        from qada.criteria import DenseCriterion

        class _RecordOracle(Observer):
            wants_oracle = True

            def on_decision(self, event: DecisionEvent) -> None:
                from qada.functional import finite_threshold_decision

                local, _ = finite_threshold_decision(event.log_local, event.log_bulk, tau_static, event.t_bulk > 0)
                calibrator.update(event.layer, local)

        run = build_run(DenseCriterion(), None, "sdpa", window, [_RecordOracle()])
    eos = {tokenizer.eos_token_id} - {None}
    for sample in tqdm(samples, desc="qada calibrate", disable=not progress):
        ids = tokenizer(sample.input, return_tensors="pt", add_special_tokens=False)["input_ids"]
        decode_greedy(model, prefill(model, ids.to(model.device)), answer_budget(sample, tokenizer), eos, run)
    return calibrator.compute()


def save_static_frequency(
    path: str | os.PathLike, frequency: torch.Tensor, model: Any, alpha: float, info: dict | None = None
) -> Path:
    """Save the calibrated frequencies and the static mask at ``alpha`` (safetensors, model fingerprint)."""
    from qada.artifacts import model_fingerprint, save_artifact

    mask = StaticCriterion.from_frequency(frequency, alpha).mask
    return save_artifact(path, "head_mask", {"mask": mask, "frequency": frequency.float()},
                         model_fingerprint(model.config), info={"alpha": alpha, **(info or {})})


def load_static_frequency(path: str | os.PathLike, model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(frequency [L, H], mask [L, H])`` from :func:`save_static_frequency` (fingerprint checked with a model)."""
    from qada.artifacts import load_artifact, model_fingerprint

    fingerprint = model_fingerprint(model.config) if model is not None else None
    tensors, _ = load_artifact(path, "head_mask", required=("mask", "frequency"), fingerprint=fingerprint)
    return tensors["frequency"], tensors["mask"]
