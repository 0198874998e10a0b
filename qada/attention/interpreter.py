"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) without its repeated language patching
(:func:`skip_repeated_patching`), and with a launch's programs run in another order (:func:`program_order`).

The interpreter runs a kernel by patching ``triton.language`` with numpy versions of its builtins, then calling the
kernel once per program. It patches again at every call of a ``@triton.jit`` helper inside the kernel, although the
kernel's own patching already holds: the patching does not depend on the function, only on which of
``triton.language`` / ``triton.language.core`` its globals see, and Triton does not undo a helper's patching when
the helper returns. qada's kernels call small helpers in their loops: on the fused kernels' tests that repeated
patching is about 40% of the interpreter's time (1,103 s against 642 s of test time without it).

:func:`skip_repeated_patching` makes a helper's call skip it when the running kernel (or a helper before it) has
patched what the helper sees; a helper that sees more is patched as before. Results are the same; only time
changes. Nothing is changed at import: the test suite and ``benchmarks/run.py --gpu --dry-run`` call it.

:func:`program_order` runs each launch's programs reversed or shuffled (the interpreter runs them in grid order, a
GPU in none), to check that kernels whose programs share memory within a launch give the same result in any order.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

_INSTALLED = "_qada_skips_repeated_patching"


def skip_repeated_patching() -> bool:
    """Install the skip in Triton's interpreter (idempotent). ``False`` (nothing changed) where Triton is missing or
    its interpreter is not built as expected."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    empty_scope = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or empty_scope is None:
        return False
    if getattr(patch_lang, _INSTALLED, False):
        return True
    running: list[frozenset[int] | None] = []  # per kernel run now executing: the languages its patching covers

    def langs(fn: Any) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values() if value is tl or value is tl.core)

    def patch_once(fn: Any) -> Any:
        seen = langs(fn)
        if running and running[-1] is not None and seen <= running[-1]:
            return empty_scope()  # a helper's call inside a kernel that patched what it sees
        scope = patch_lang(fn)
        if running:  # the kernel's own patching, or a helper's that saw more (``tl.max`` sees ``tl.core``)
            running[-1] = seen | (running[-1] or frozenset())
        return scope

    run_grid = executor.__call__

    def run_tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        running.append(None)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            running.pop()

    setattr(patch_once, _INSTALLED, True)
    interpreter._patch_lang = patch_once
    executor.__call__ = run_tracked
    return True


PROGRAM_ORDERS = ("natural", "reversed", "shuffled")
"""The orders :func:`program_order` runs a launch's programs in."""


@contextlib.contextmanager
def program_order(order: str, seed: int = 0) -> Iterator[None]:
    """Within: Triton's interpreter runs each launch's programs in ``order`` instead of its own (``natural``: program
    0, 1, ... of the flattened grid; ``reversed``: the last first; ``shuffled``: a random permutation per launch, from
    ``seed`` and the launch's number). Every program still runs once, one after the other.

    On a GPU a launch's programs start and finish in no set order, so a kernel whose programs share memory within a
    launch (one writes what another reads, the last to arrive finishes for the others) must give the same result in
    every order; the interpreter alone only ever tries the natural one. Raises ``RuntimeError`` where Triton's
    interpreter is not built as expected (its builder's ``set_grid_dim`` / ``set_grid_idx``)."""
    if order not in PROGRAM_ORDERS:
        raise ValueError(f"expected an order of {PROGRAM_ORDERS} but got {order!r}")
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    set_dim, set_idx = getattr(builder, "set_grid_dim", None), getattr(builder, "set_grid_idx", None)
    if set_dim is None or set_idx is None:
        raise RuntimeError("Triton's interpreter has no builder with set_grid_dim / set_grid_idx to reorder programs")
    launches = [0]
    programs: list[tuple[int, int, int]] = []

    def grid_dim(nx: int, ny: int, nz: int) -> None:  # called once per launch, before its programs
        set_dim(nx, ny, nz)
        programs[:] = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        if order == "reversed":
            programs.reverse()
        elif order == "shuffled":
            random.Random(seed * 1_000_003 + launches[0]).shuffle(programs)
        launches[0] += 1

    def grid_idx(x: int, y: int, z: int) -> None:  # the interpreter's n-th program runs as programs[n]
        _, ny, nz = builder.grid_dim
        set_idx(*programs[(x * ny + y) * nz + z])

    own = {name: vars(builder)[name] for name in ("set_grid_dim", "set_grid_idx") if name in vars(builder)}
    builder.set_grid_dim, builder.set_grid_idx = grid_dim, grid_idx
    try:
        yield
    finally:
        del builder.set_grid_dim, builder.set_grid_idx  # the class's methods again, or an enclosing order's
        for name, value in own.items():
            setattr(builder, name, value)
