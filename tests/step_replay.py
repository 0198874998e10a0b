"""Replay a run's layer steps: record every call of a decode (its arguments copied as they were, views kept), then
run two implementations of the step on identical copies of each call and name the first output or input state in
which they differ. Tells a difference of the step itself (e.g. a compiled step against the eager one) from one of the
harness around it (both give the same results on the same inputs). The same one level down: every kernel launch of
a decode recorded (:func:`recording_launches`), then replayed by two launchers (:func:`replay_launches`), names the
first kernel whose launches differ."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

from qada.models.layer_step import LayerStep


def clone_aliased(args: Any) -> Any:
    """``args`` with every tensor copied, the tensors that share a storage sharing one copy of it (the same views:
    offsets, shapes and strides), anything else as is."""
    copies: dict[int, Any] = {}

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in copies:
            copies[key] = storage.clone()
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(copies[key], t.storage_offset(), t.shape,
                                                                   t.stride())  # fmt: skip

    return tree_map(copy, args)


@contextlib.contextmanager
def recording_layer_steps() -> Iterator[list[tuple[LayerStep, bool, tuple]]]:
    """Inside it, every :class:`~qada.models.layer_step.LayerStep` call is recorded as ``(step, buffered, arguments
    copied before the call (:func:`clone_aliased`))`` in the list it yields, then made as usual."""
    calls: list[tuple[LayerStep, bool, tuple]] = []
    original = LayerStep.__call__

    def record(self: LayerStep, buffered: bool, *args: Any) -> Any:
        calls.append((self, buffered, clone_aliased(args)))
        return original(self, buffered, *args)

    LayerStep.__call__ = record
    try:
        yield calls
    finally:
        LayerStep.__call__ = original


def _differences(name: str, first: Any, second: Any) -> list[str]:
    """The leaves of ``first`` and ``second`` (same structure) that differ, each as ``"name<path>: ..."``."""
    left, left_spec = tree_flatten_with_path(first)
    right, right_spec = tree_flatten_with_path(second)
    if left_spec != right_spec:
        return [f"{name}: structure {left_spec} vs {right_spec}"]
    found = []
    for (path, a), (_, b) in zip(left, right, strict=True):
        where = name + keystr(path)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                found.append(f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
            elif not torch.equal(a, b) and not (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                                and torch.equal(a.nan_to_num(), b.nan_to_num())):  # fmt: skip
                unequal = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
                worst = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
                found.append(f"{where} {tuple(a.shape)}: {int(unequal.sum())} elements differ (max |diff| "
                             f"{worst:.3g}), first at {tuple(unequal.nonzero()[0].tolist())}")
        elif a != b and not (isinstance(a, float) and a != a and b != b):
            found.append(f"{where}: {a!r} vs {b!r}")
    return found


def replay(calls: list[tuple[LayerStep, bool, tuple]], first: Callable[[LayerStep, tuple], Any],
           second: Callable[[LayerStep, tuple], Any]) -> list[str]:
    """Run ``first(step, args)`` and ``second(step, args)`` on two identical copies of each recorded call, in order;
    return the differences of the first call whose results (the :class:`~qada.models.step_parts.LayerStepResult`)
    or arguments after the call (the states a step updates in place) differ, each prefixed with the call's index,
    or ``[]`` when every call agrees."""
    for index, (step, _, args) in enumerate(calls):
        a, b = clone_aliased(args), clone_aliased(args)
        with torch.no_grad():
            result_a, result_b = first(step, a), second(step, b)
        found = [line for field in result_a._fields
                 for line in _differences(f"result.{field}", getattr(result_a, field), getattr(result_b, field))]
        found += _differences("arguments after", a, b)
        if found:
            return [f"call {index}: {line}" for line in found]
    return []


@contextlib.contextmanager
def recording_launches() -> Iterator[list[tuple[Any, tuple, tuple, dict]]]:
    """Inside it, every kernel launch through :func:`qada.attention._triton_kernel.run` is recorded as ``(kernel,
    grid, positional arguments copied before the launch (:func:`clone_aliased`), keyword arguments)`` in the list it
    yields, then made as usual."""
    from qada.attention import _triton_kernel

    launches: list[tuple[Any, tuple, tuple, dict]] = []
    original = _triton_kernel.run

    def record(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
        launches.append((kernel, tuple(grid), clone_aliased(args), dict(kwargs)))
        return original(kernel, grid, *args, **kwargs)

    _triton_kernel.run = record
    try:
        yield launches
    finally:
        _triton_kernel.run = original


Launcher = Callable[[Any, tuple, tuple, dict], None]


def replay_launches(launches: list[tuple[Any, tuple, tuple, dict]], first: Launcher, second: Launcher) -> list[str]:
    """Make each recorded launch with ``first(kernel, grid, args, kwargs)`` and ``second(...)`` on two identical
    copies of its arguments, in order; return the tensors that differ after the first launch whose results differ
    (every argument compared: what the kernel wrote), each prefixed with the launch's index and kernel, or ``[]``."""
    for index, (kernel, grid, args, kwargs) in enumerate(launches):
        a, b = clone_aliased(args), clone_aliased(args)
        with torch.no_grad():
            first(kernel, grid, a, kwargs)
            second(kernel, grid, b, kwargs)
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        found = _differences("arguments after", a, b)
        if found:
            return [f"launch {index} ({name}): {line}" for line in found]
    return []
