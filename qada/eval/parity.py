"""Decisions on two devices: the same model, prompt and dtype decoded on each, every layer's decisions compared.

A run's decisions depend on arithmetic that differs between devices (reduction orders, fused kernels), so two
devices may disagree on a head whose ratio lies at the threshold. Rounding explains a disagreement only there: a
head counts as *near tau* when the reference device itself decides it differently at ``tau - delta`` and at
``tau + delta`` (for a threshold rule, exactly when its ratio lies in ``[tau - delta, tau + delta)``), which needs
no access to the criterion's ratio. Any other disagreement is a real difference between the devices.

Both devices decode the same tokens (teacher forcing: the prompt, then a fixed continuation), so a disagreement at
one step never changes the inputs of the next.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qada.models.observers import DecisionRecorder

__all__ = ["ParityReport", "compare_decisions", "decision_parity", "record_decisions"]

Decisions = dict[tuple[int, int], torch.Tensor]
"""``(layer, decode step) -> [b, H]`` bool, the criterion's decision (True = local), on the CPU."""


@torch.no_grad()
def record_decisions(model: Any, input_ids: torch.Tensor, continuation: Sequence[int], criterion: Any,
                     moments: Any = "stored", tokenizer: Any = None, compile: bool | None = None,
                     executor: Any = "sdpa") -> tuple[Decisions, dict[str, Any]]:
    """Decode ``continuation`` after ``input_ids [1, T]`` (teacher forcing) with qada attached to ``model`` (on its
    device, in its dtype) and return every layer's decisions and the run's :meth:`~qada.models.run.QAdARun.describe`
    (which stored reference it read).

    The prefill is dense (qada starts at the first decode step, as in every evaluation); the cache is a static one
    sized for the continuation.
    """
    from qada.eval.decode import prefill, prefill_from_cache
    from qada.models import attach, build_run, prepare_run
    from qada.models.generation import copy_to_cache

    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"expected input_ids of shape [1, T] but got {tuple(input_ids.shape)}")
    if not continuation:
        raise ValueError("expected at least one continuation token to decode")
    device = next(model.parameters()).device
    recorder = DecisionRecorder()
    run = prepare_run(build_run(criterion=copy.deepcopy(criterion), moments=moments, executor=executor,
                                observers=[recorder], compile=compile), model, tokenizer)
    ids = input_ids.to(device)
    done = prefill(model, ids, keep_queries=run.criterion.prompt_queries())
    cache = copy_to_cache(model, done.cache, "static", ids.shape[1] + len(continuation) + 1)
    attach(model, run)
    try:
        prefill_from_cache(run, cache, queries=done.queries)
        for position, token in enumerate(continuation, start=ids.shape[1]):
            model(input_ids=torch.tensor([[int(token)]], device=device), past_key_values=cache, use_cache=True,
                  cache_position=torch.tensor([position], device=device))
        described = run.describe()
    finally:
        run.remove()
    return {(e.layer, e.step): e.local.bool() for e in recorder.events}, described


@dataclass
class ParityReport:
    """How two devices' decisions compare.

    Attributes:
        decisions: head decisions compared (layers x steps x rows x heads).
        mismatched: those the devices decided differently.
        near_tau: of those, heads the reference decides differently at ``tau - delta`` and ``tau + delta``
            (within rounding of tau).
        unexplained: mismatches that are not near tau (0 for equal decisions).
        sparsity: the fraction of local decisions on each device, ``{"reference": .., "other": ..}``.
        per_layer: ``layer -> unexplained mismatches``.
        missing: ``(layer, step)`` pairs decided on one device only.
    """

    decisions: int
    mismatched: int
    near_tau: int
    unexplained: int
    sparsity: dict[str, float]
    per_layer: dict[int, int] = field(default_factory=dict)
    missing: list[tuple[int, int]] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """No unexplained mismatch and the same (layer, step) pairs decided."""
        return self.unexplained == 0 and not self.missing


def compare_decisions(reference: Decisions, other: Decisions, below: Decisions | None = None,
                      above: Decisions | None = None) -> ParityReport:
    """Compare ``other``'s decisions with ``reference``'s; ``below`` / ``above``: the reference device's decisions
    at ``tau - delta`` / ``tau + delta`` on the same tokens (both or neither), which excuse the heads near tau."""
    if (below is None) != (above is None):
        raise ValueError("expected both decisions at tau - delta and at tau + delta, or neither")
    keys = sorted(set(reference) & set(other))
    missing = sorted(set(reference) ^ set(other))
    total = mismatched = near = unexplained = 0
    local = {"reference": 0, "other": 0}
    per_layer: dict[int, int] = {}
    for key in keys:
        a, b = reference[key], other[key]
        if a.shape != b.shape:
            raise ValueError(f"expected decisions of one shape at (layer, step) {key} but got {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
        differ = a != b
        excused = torch.zeros_like(differ)
        if below is not None and key in below and key in above:
            excused = below[key] != above[key]
        total += a.numel()
        mismatched += int(differ.sum())
        near += int((differ & excused).sum())
        bad = int((differ & ~excused).sum())
        unexplained += bad
        per_layer[key[0]] = per_layer.get(key[0], 0) + bad
        local["reference"] += int(a.sum())
        local["other"] += int(b.sum())
    sparsity = {name: count / total if total else 0.0 for name, count in local.items()}
    return ParityReport(total, mismatched, near, unexplained, sparsity, per_layer, missing)


def decision_parity(reference_model: Any, other_model: Any, input_ids: torch.Tensor, continuation: Sequence[int],
                    criterion: Mapping[str, Any], moments: Any = "stored", tokenizer: Any = None,
                    compile: bool | None = None, delta: float = 0.01, executor: Any = "sdpa",
                    other_executor: Any = None) -> tuple[ParityReport, dict[str, Any]]:
    """Decisions of ``criterion`` (a config with ``tau``) on ``other_model`` against ``reference_model`` (the same
    weights on another device), on the same tokens; the reference also decodes at ``tau -+ delta`` to tell heads
    near tau. Returns the report and both runs' descriptions (``{"reference": .., "other": ..}``)."""
    if "tau" not in criterion:
        raise ValueError(f"expected a threshold criterion config with a 'tau' but got {dict(criterion)}")
    tau = float(criterion["tau"])

    def at(model: Any, value: float, chosen_executor: Any) -> tuple[Decisions, dict[str, Any]]:
        return record_decisions(model, input_ids, continuation, {**criterion, "tau": value}, moments, tokenizer,
                                compile, chosen_executor)

    reference, described_reference = at(reference_model, tau, executor)
    other, described_other = at(other_model, tau, other_executor or executor)
    below, _ = at(reference_model, max(tau - delta, 0.0), executor)
    above, _ = at(reference_model, min(tau + delta, 1.0), executor)
    return compare_decisions(reference, other, below, above), {"reference": described_reference,
                                                               "other": described_other}
