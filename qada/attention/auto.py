"""The ``auto`` executor: the fastest built-in executor for where the model runs.

A run resolves it when it is attached to a model (:meth:`~qada.models.run.QAdARun.resolve_executor`), from the
model's device and dtype and from whether the criterion's decision can be made in the kernel:

* a CUDA device, Triton installed, float16 / bfloat16 / float32, and a criterion the fused kernels decide (plain
  ``qada``, ``qada_budget``, ``qada_tail``, ``qada_tail_budget`` with a moment source): ``triton_fused`` (three to
  four launches per layer and step: moment step, decision, attention, combine);
* the same for any other criterion: ``triton`` (the split-K kernel that skips the bulk of local KV groups);
* anything else (the CPU, no Triton or one older than 3.3, another dtype): ``sdpa``.

Every executor computes the same attention; the choice changes only what a step costs. Called directly (outside a
run, :func:`~qada.attention.decode_attention`) it chooses by the step's tensors, without a criterion: ``triton``
on a CUDA device with Triton, else ``sdpa``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from qada.attention.base import EXECUTORS, AttentionExecutor, GroupDecision, register_executor
from qada.attention.triton_decode import MIN_TRITON_TEXT, TRITON_DTYPES, older_triton
from qada.step import DecodeStep

__all__ = ["AutoExecutor", "executor_for"]


def executor_for(device: torch.device, dtype: torch.dtype, fusable: bool,
                 triton_installed: bool | None = None) -> tuple[str, str]:
    """``(name, reason)``: the executor ``auto`` picks for a model on ``device`` in ``dtype`` whose criterion the fused
    kernels can decide (``fusable``); ``triton_installed``: whether Triton can be imported (``None``: look)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "sdpa", f"the model is on {device.type}: the Triton kernels need a CUDA device"
    if dtype not in TRITON_DTYPES:
        return "sdpa", f"the model is in {dtype}: the Triton kernels take float16, bfloat16 or float32"
    importable = importlib.util.find_spec("triton") is not None
    if not (importable if triton_installed is None else triton_installed):
        return "sdpa", "Triton is not installed (pip install 'qada[triton]')"
    found = older_triton() if importable else None  # (a caller may say installed where it is not: a test)
    if found is not None:
        return "sdpa", f"Triton {found} is older than the kernels need ({MIN_TRITON_TEXT}; pip install 'qada[triton]')"
    if fusable:
        return "triton_fused", "CUDA and Triton: the decision is made in the attention kernel"
    return "triton", ("CUDA and Triton; the criterion's decision is not one the fused kernels make (plain 'qada', "
                      "'qada_budget', 'qada_tail', 'qada_tail_budget' with a moment source)")


@register_executor("auto")
@dataclass
class AutoExecutor(AttentionExecutor):
    """Stands for the executor :func:`executor_for` picks (module docstring); a run replaces it by that executor when
    it is attached to a model, which ``run.executor`` then is. Arguments as for
    :class:`~qada.attention.AttentionExecutor` (``group_policy`` goes to the chosen executor)."""

    _chosen: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def choose(self, device: torch.device, dtype: torch.dtype, fusable: bool = False) -> tuple[AttentionExecutor, str]:
        """``(executor, reason)``: the executor for ``device`` and ``dtype`` (:func:`executor_for`), built with this
        one's ``group_policy``."""
        name, reason = executor_for(device, dtype, fusable)
        return EXECUTORS.build(name, group_policy=self.group_policy), reason

    def attend(self, step: DecodeStep, decision: GroupDecision) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chosen executor's :meth:`~qada.attention.AttentionExecutor.attend` (chosen once per device and dtype,
        without a criterion: nothing fused)."""
        key = (step.device, step.query.dtype)
        if key not in self._chosen:
            executor, _ = self.choose(*key)
            executor.to_device(step.device)
            self._chosen[key] = executor
        return self._chosen[key].attend(step, decision)
