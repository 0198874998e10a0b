"""Test helpers for the Triton executors' launch discipline: which kernels a call launches (and on which grid),
which torch operations it runs besides them, and that it never reads a device value on the host."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__")

ALLOCATIONS_AND_VIEWS = frozenset({"aten.empty.memory_format", "aten.view.dtype", "aten.view.default",
                                   "aten.select.int", "aten.detach.default"})
"""The torch operations a launcher may run besides its Triton launches: allocations and views, no kernel."""


class LaunchRecorder(TorchDispatchMode):
    """Inside ``with recorder:``, ``ops`` collects the names of the torch operations run outside Triton launches;
    from construction on, ``launches`` collects ``(kernel name, grid)`` of every launch through
    ``qada.attention._triton_kernel.run`` (patched with ``monkeypatch``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from qada.attention import _triton_kernel

        super().__init__()
        self.ops: list[str] = []
        self.launches: list[tuple[str, tuple]] = []
        self.paused = False
        run = _triton_kernel.run

        def counted(kernel, grid, *args, **kwargs):
            self.launches.append((kernel.fn.__name__, grid))
            self.paused = True  # the interpreter's own host copies are not the executor's work
            try:
                run(kernel, grid, *args, **kwargs)
            finally:
                self.paused = False

        monkeypatch.setattr(_triton_kernel, "run", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def refusing_host_reads(monkeypatch: pytest.MonkeyPatch):
    """Within it, a host read of a tensor value (``item``, ``bool(t)``, ...) fails the test."""
    with monkeypatch.context() as patched:
        for name in HOST_READS:
            patched.setattr(torch.Tensor, name, lambda *a, _n=name, **kw: pytest.fail(f"host sync: Tensor.{_n}"))
        yield


def fused_step_launches(source: str, criterion: str, decide_once: bool = False,
                        estimate_in_splits: bool = False) -> list[str]:
    """The kernels one ``triton_fused`` layer step launches, in order: the moment step of ``source`` (``stored`` or
    ``current``; it runs a ``qada_tail`` step's page-top programs too, where its pages are spread over them), the
    fused split of ``criterion`` (``qada``, or a name starting ``qada_tail``; none for ``qada`` with
    ``decide_once``: the moment step's launch decides; ``qada_budget...``: its score launch instead), the ``triton``
    split where the decision is made apart (``decide_once`` or a budget, which that split ranks), then the
    combine. With ``estimate_in_splits`` (plain ``qada`` decided in the splits) the split, then the combine that
    steps the moments for the next step."""
    if estimate_in_splits and criterion == "qada" and not decide_once:
        return ["qada_fused_split_kernel", f"combine_and_{source}_step_kernel"]
    tail = criterion.startswith("qada_tail")
    if criterion.startswith("qada_budget"):
        split = ["qada_budget_score_kernel"]
    elif tail or not decide_once:
        split = ["qada_tail_fused_split_kernel" if tail else "qada_fused_split_kernel"]
    else:
        split = []
    budget = criterion.startswith(("qada_tail_budget", "qada_budget"))
    apart = ["qada_decode_split_kernel"] if decide_once or budget else []
    return [f"{source}_moment_step_kernel", *split, *apart, "qada_decode_combine_kernel"]
