"""The device parity section of the GPU suite (``--only parity``): every layer's decisions on the suite's device
against the CPU's, on the same model, prompt, tokens and dtype (:mod:`qada.eval.parity`).

The CPU decodes a pass-key prompt greedily with the dense model (the tokens every run is then forced along), and
records each configuration's decisions with the ``sdpa`` executor, eagerly: the reference. It also records them at
``tau -+ delta``, which tells the heads whose ratio lies within rounding of tau (the only disagreements rounding
explains). The device then records each configuration with each executor (the ``triton`` executor after the torch
decision, ``triton_fused`` deciding inside its kernels, and with the estimate in its splits), and each row says how
many decisions differ, how many of those lie near tau, and how many do not (``unexplained``: 0 where the devices
decide alike). ``tests/test_device_parity.py`` asserts the same on a GPU (``pytest -m gpu``), compiled steps too.

On the CPU (``--gpu --dry-run``) the "device" is the CPU again, the Triton executors in Triton's interpreter: the
code path at a tiny cost, not a parity result.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import keep_first_layers

__all__ = ["EXECUTORS", "ParityCases", "run_parity"]

EXECUTORS: dict[str, dict[str, Any]] = {
    "triton": {"name": "triton"},
    "triton_fused": {"name": "triton_fused"},
    "triton_fused estimating": {"name": "triton_fused", "estimate_in_splits": True},
}
"""The device's executors by row name: the torch decision then the ``triton`` kernels; the decision inside the
``triton_fused`` kernels; the same with each split estimating ``log E[exp(s)]`` itself and the moments stepped one
decode step ahead (``estimate_in_splits``: a plain ``qada`` decision only)."""


@dataclass(frozen=True)
class ParityCases:
    """What the parity section decodes.

    Attributes:
        length: prompt length in tokens (a pass-key prompt of the embedded SmolLM2).
        tokens: decode steps (greedy tokens of the dense model on the CPU, forced on both devices).
        layers: keep only the first ``layers`` layers (the dry run); ``None``: all.
        criteria: ``(name, tau)`` of each threshold criterion.
        moments: the moment sources (``stored``: the reference both devices read is named in each row).
        executors: names of :data:`EXECUTORS`.
        compiled: the device's runs with the layer step compiled (``True``) and eagerly (``False``).
        delta: the band around tau that tells heads near it.
        dtype: both devices' dtype (float32: bfloat16 rounding would move more heads across tau).
    """

    length: int = 2048
    tokens: int = 8
    layers: int | None = None
    criteria: tuple[tuple[str, float], ...] = (("qada", 0.6), ("qada_tail", 0.3))
    moments: tuple[str, ...] = ("stored", "current")
    executors: tuple[str, ...] = tuple(EXECUTORS)
    compiled: tuple[bool, ...] = (False,)
    delta: float = 0.01
    dtype: torch.dtype = torch.float32


def load_embedded(cases: ParityCases, device: torch.device) -> tuple[Any, Any]:
    """The embedded SmolLM2 on ``device`` in ``cases.dtype`` (its first ``cases.layers`` layers where given)."""
    from qada.models.loading import load_model

    model, tokenizer = load_model("smollm2-135m", dtype=cases.dtype, device=device)
    if cases.layers:
        keep_first_layers(model, cases.layers)
    return model, tokenizer


def applies(criterion: str, executor: str) -> bool:
    """Whether ``executor`` is a distinct case for ``criterion`` (``estimate_in_splits`` changes a plain ``qada``
    decision only)."""
    return criterion == "qada" or not EXECUTORS[executor].get("estimate_in_splits")


def _reference_named(described: dict[str, Any]) -> dict[str, Any] | None:
    moments = described.get("moments") or {}
    named = {k: moments[k] for k in ("prompt", "file", "fingerprint") if k in moments}
    return named or None


def compared(reference: Any, below: Any, above: Any, other: Any, described_reference: dict[str, Any],
             described: dict[str, Any]) -> dict[str, Any]:
    """A row's comparison: the device's decisions ``other`` against the CPU's ``reference`` (``below`` / ``above``:
    the CPU's at ``tau -+ delta``), and the stored reference each device's run read."""
    from qada.eval.parity import compare_decisions

    report = compare_decisions(reference, other, below, above)
    named_cpu, named_device = _reference_named(described_reference), _reference_named(described)
    return dict(decisions=report.decisions, mismatched=report.mismatched, near_tau=report.near_tau,
                unexplained=report.unexplained, missing=len(report.missing), equal=report.equal,
                sparsity_cpu=report.sparsity["reference"], sparsity_device=report.sparsity["other"],
                reference_cpu=named_cpu, reference_device=named_device, same_reference=named_cpu == named_device)


def run_parity(cases: ParityCases, device: torch.device, log: Callable[..., None],
               on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One row per (criterion, moments, executor, compiled) that applies: the device's decisions against the CPU's
    (module docstring). A case that fails is a row with its ``error``; the others still run."""
    from qada.eval.parity import record_decisions
    from qada.eval.passkey import passkey_prompt

    cpu = torch.device("cpu")
    reference_model, tokenizer = load_embedded(cases, cpu)
    other_model = reference_model if device == cpu else load_embedded(cases, device)[0]
    ids = passkey_prompt(tokenizer, length=cases.length, depth=0.5, seed=0).input_ids[:, : cases.length]
    with torch.no_grad():
        out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cases.tokens,
                                       do_sample=False, pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    continuation = out[0, ids.shape[1]:].tolist()

    def decide(model: Any, name: str, tau: float, moments: str, compile: bool, executor: Any) -> tuple[dict, dict]:
        return record_decisions(model, ids, continuation, {"name": name, "tau": tau}, moments, tokenizer,
                                compile=compile, executor=executor)  # fmt: skip

    rows: list[dict[str, Any]] = []
    for name, tau in cases.criteria:
        for moments in cases.moments:
            log(f"  parity {name} tau {tau} {moments}: the CPU's decisions (sdpa, eager; and at tau -+ {cases.delta})")
            try:
                (reference, described_reference), (below, _), (above, _) = [
                    decide(reference_model, name, value, moments, False, "sdpa")
                    for value in (tau, max(tau - cases.delta, 0.0), min(tau + cases.delta, 1.0))]
                failed = None
            except Exception as exc:  # its cases become rows with the error; the other configurations still run
                failed = f"the CPU's reference decisions: {exc!r}"
                log(traceback.format_exc())
            for executor in (e for e in cases.executors if applies(name, e)):
                for compiled in cases.compiled:
                    row: dict[str, Any] = dict(criterion=name, tau=tau, moments=moments, executor=executor,
                                               compiled=compiled, device=str(device), length=cases.length,
                                               tokens=len(continuation), dtype=str(cases.dtype).replace("torch.", ""))
                    started = time.perf_counter()
                    try:
                        if failed:  # (no reference to compare with)
                            row["error"] = failed[:500]
                        else:
                            other, described = decide(other_model, name, tau, moments, compiled,
                                                      dict(EXECUTORS[executor]))  # fmt: skip
                            row.update(compared(reference, below, above, other, described_reference, described))
                            log(f"    {executor}{' compiled' if compiled else ''}: {row['mismatched']} of "
                                f"{row['decisions']} differ, {row['near_tau']} near tau, {row['unexplained']} "
                                "unexplained")
                    except Exception as exc:  # a failed case must not lose the others
                        row["error"] = f"{exc!r}"[:500]
                        log(traceback.format_exc())
                    row["seconds"] = round(time.perf_counter() - started, 2)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    return rows
