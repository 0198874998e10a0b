"""RULER's scoring, as defined in ``long_context_eval/eval/synthetic/constants.py`` and ``eval/evaluate.py``.

* ``string_match_all`` (niah, vt, cwe, fwe): per sample, the fraction of references that occur in the
  prediction (case-insensitive substring); averaged over samples, times 100, rounded to 2 decimals.
* ``string_match_part`` (qa): per sample, 100 if any reference occurs in the prediction, else 0; averaged.

Predictions are first post-processed as RULER does (:func:`postprocess_pred`): ``None`` becomes ``""``,
surrounding whitespace is stripped and control characters ``\\x00-\\x1f`` become newlines.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "METRICS",
    "postprocess_pred",
    "score",
    "string_match_all",
    "string_match_all_per_sample",
    "string_match_part",
    "string_match_part_per_sample",
]

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(pred: str | None) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines, strip again."""
    if pred is None:
        return ""
    return _CONTROL.sub("\n", pred.strip()).strip()


def _check(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if isinstance(preds, str) or isinstance(refs, str):
        raise TypeError("expected a list of predictions and a list of reference lists, not a single string")
    if len(preds) != len(refs):
        raise ValueError(f"expected as many predictions as references but got {len(preds)} and {len(refs)}")
    if len(preds) == 0:
        raise ValueError("expected at least one prediction")
    for i, ref in enumerate(refs):
        if isinstance(ref, str) or len(ref) == 0:
            raise ValueError(f"expected references[{i}] to be a non-empty list of strings but got {ref!r}")


def _hits(pred: str, ref: Sequence[str]) -> list[float]:
    pred = pred.lower()
    return [1.0 if r.lower() in pred else 0.0 for r in ref]


def string_match_all_per_sample(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> list[float]:
    """Per-sample 0-100 scores: the share of a sample's references found in its prediction."""
    _check(preds, refs)
    return [sum(_hits(p, r)) / len(r) * 100 for p, r in zip(preds, refs, strict=True)]


def string_match_part_per_sample(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> list[float]:
    """Per-sample 0-100 scores: 100 if any of a sample's references is found in its prediction."""
    _check(preds, refs)
    return [max(_hits(p, r)) * 100 for p, r in zip(preds, refs, strict=True)]


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_all``: mean share of references found, in 0-100, rounded to 2 decimals."""
    _check(preds, refs)
    score = sum(sum(_hits(p, r)) / len(r) for p, r in zip(preds, refs, strict=True)) / len(preds) * 100
    return round(score, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_part``: share of samples with any reference found, in 0-100, rounded."""
    _check(preds, refs)
    score = sum(max(_hits(p, r)) for p, r in zip(preds, refs, strict=True)) / len(preds) * 100
    return round(score, 2)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(task: str, preds: Sequence[str | None], refs: Sequence[Sequence[str]], postprocess: bool = True) -> float:
    """Score predictions of a registered task (or any name starting with ``qa``) with RULER's metric.

    Predictions are post-processed with :func:`postprocess_pred` unless ``postprocess=False``.
    """
    from qada.eval.tasks.base import TASKS

    if task in TASKS:
        metric = TASKS.get(task).metric
    else:
        metric = "string_match_part" if task.startswith("qa") else "string_match_all"
    preds = [postprocess_pred(p) for p in preds] if postprocess else list(preds)
    return METRICS[metric](preds, refs)
