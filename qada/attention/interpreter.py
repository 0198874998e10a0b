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

:func:`program_order` runs each launch's programs reversed, shuffled or interleaved (the interpreter runs them one
after the other in grid order, a GPU side by side in none), to check that kernels whose programs share memory within
a launch give the same result in any order.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
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


PROGRAM_ORDERS = ("natural", "reversed", "shuffled", "interleaved")
"""The orders :func:`program_order` runs a launch's programs in."""

_MEMORY_OPERATIONS = ("load", "store", "atomic")
"""The interpreter builder's operations (``create_*`` methods whose name holds one of these) before which an
interleaved program hands over to another."""


class _Abandoned(BaseException):
    """Ends a program thread of an interleaved launch that another program's error stopped."""


class _Interleaving:
    """A launch's programs run as threads, one at a time: before each memory operation the running program hands over
    to one of the unfinished programs (itself included) drawn by ``rng``. What a GPU may do between two programs'
    loads and stores (under sequential consistency): a program may read another's store of the same launch, or not
    yet, at any of its operations."""

    def __init__(self, builder: Any, rng: random.Random) -> None:
        self.builder, self.rng = builder, rng
        self.changed = threading.Condition()
        self.turn: int | None = None  # the program that may run
        self.unfinished: list[int] = []
        self.error: BaseException | None = None
        self.local = threading.local()  # .program: the index of the program this thread runs

    def run(self, fn: Any, programs: list[tuple[tuple[int, int, int], dict[str, Any]]]) -> None:
        """Run ``fn(**args)`` as each of ``programs`` ``(grid index, args)``, interleaved; raise the first error."""
        self.unfinished = list(range(len(programs)))
        threads = [threading.Thread(target=self._program, args=(n, fn, index, args), daemon=True)
                   for n, (index, args) in enumerate(programs)]
        for thread in threads:
            thread.start()
        with self.changed:
            self.turn = self.rng.choice(self.unfinished)
            self.changed.notify_all()
            self.changed.wait_for(lambda: not self.unfinished)
        for thread in threads:
            thread.join()
        if self.error is not None:
            raise self.error

    def _program(self, n: int, fn: Any, index: tuple[int, int, int], args: dict[str, Any]) -> None:
        self.local.program = (n, index)
        try:
            self._wait_for_turn()
            fn(**args)
        except _Abandoned:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the launching thread
            with self.changed:
                self.error = self.error or error
        finally:
            with self.changed:
                self.unfinished.remove(n)
                if self.error is not None:
                    self.turn = None  # the others stop at their next turn
                elif self.unfinished:
                    self.turn = self.rng.choice(self.unfinished)
                self.changed.notify_all()

    def _wait_for_turn(self) -> None:
        n, index = self.local.program
        with self.changed:
            self.changed.wait_for(lambda: self.turn == n or self.error is not None)
            if self.error is not None:
                raise _Abandoned
        self.builder.grid_idx = index

    def hand_over(self) -> None:
        """Before a memory operation of a program thread: let a random unfinished program run until its own."""
        if getattr(self.local, "program", None) is None:
            return
        with self.changed:
            self.turn = self.rng.choice(self.unfinished)
            self.changed.notify_all()
        self._wait_for_turn()


@dataclass
class _Order:
    """One :func:`program_order` context: its order, its seed and the launches it has reordered."""

    name: str
    seed: int
    launches: int = 0

    def run(self, builder: Any, fn: Any, programs: list[tuple[tuple[int, int, int], dict[str, Any]]]) -> None:
        """Run ``fn(**args)`` as each of ``programs`` ``(grid index, args)`` (grid order) in this order."""
        rng = random.Random(self.seed * 1_000_003 + self.launches)
        self.launches += 1
        if self.name == "interleaved":
            _INTERLEAVINGS.append(_Interleaving(builder, rng))
            try:
                _INTERLEAVINGS[-1].run(fn, programs)
            finally:
                _INTERLEAVINGS.pop()
            return
        if self.name == "reversed":
            programs = programs[::-1]
        elif self.name == "shuffled":
            rng.shuffle(programs)
        for index, args in programs:
            builder.grid_idx = index
            fn(**args)


_ORDERS: list[_Order] = []
"""The :func:`program_order` contexts entered, innermost last (the interpreter's hooks are installed while any is)."""

_INTERLEAVINGS: list[_Interleaving] = []
"""The interleaved launch running now, if any."""


def _install_order_hooks() -> Any:
    """Hook Triton's interpreter so that each launch runs its programs by ``_ORDERS[-1]``; returns the undo."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    executor = getattr(interpreter, "GridExecutor", None)
    set_dim = getattr(builder, "set_grid_dim", None)
    memory = [name for name in dir(builder) if name.startswith("create_")
              and any(word in name for word in _MEMORY_OPERATIONS)]
    if executor is None or set_dim is None or not hasattr(builder, "set_grid_idx") or not memory:
        raise RuntimeError("Triton's interpreter has no GridExecutor / builder with set_grid_dim, set_grid_idx and "
                           "memory operations to reorder programs by")
    running: list[Any] = []  # the GridExecutor of each launch now running (innermost last)

    def grid_dim(nx: int, ny: int, nz: int) -> None:  # once per launch, after the executor read the kernel's arguments
        set_dim(nx, ny, nz)
        if not running or not _ORDERS:
            return
        launch, fn, order = running[-1], running[-1].fn, _ORDERS[-1]
        total, programs = nx * ny * nz, []

        def deferred(**args: Any) -> None:  # the interpreter's loop calls it once per program, in grid order
            programs.append((builder.grid_idx, args))
            if len(programs) == total:
                order.run(builder, fn, programs)

        launch.fn = deferred

    run_grid = executor.__call__

    def run_reordered(self: Any, *args: Any, **kwargs: Any) -> Any:
        fn = self.fn
        running.append(self)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            running.pop()
            self.fn = fn

    def before_memory(operation: Any) -> Any:
        def operate(*args: Any, **kwargs: Any) -> Any:
            if _INTERLEAVINGS:
                _INTERLEAVINGS[-1].hand_over()
            return operation(*args, **kwargs)
        return operate

    own = {name: vars(builder)[name] for name in ("set_grid_dim", *memory) if name in vars(builder)}
    builder.set_grid_dim = grid_dim
    for name in memory:
        setattr(builder, name, before_memory(getattr(builder, name)))
    executor.__call__ = run_reordered

    def undo() -> None:
        executor.__call__ = run_grid
        for name in ("set_grid_dim", *memory):
            delattr(builder, name)  # the class's methods again, or what was set on the builder before
        for name, value in own.items():
            setattr(builder, name, value)

    return undo


@contextlib.contextmanager
def program_order(order: str, seed: int = 0) -> Iterator[None]:
    """Within: Triton's interpreter runs each launch's programs in ``order`` instead of its own: ``natural`` (program
    0, 1, ... of the flattened grid, one after the other), ``reversed`` (the last first), ``shuffled`` (a random
    permutation per launch) or ``interleaved`` (all at once, as threads taking turns: before each load, store or
    atomic operation the running program hands over to a random unfinished one, :class:`_Interleaving`). Random
    choices come from ``seed`` and the launch's number, so a failure repeats. Nested, the innermost order holds.

    On a GPU a launch's programs start and finish in no set order and run side by side, so a kernel whose programs
    share memory within a launch (one writes what another reads, the last to arrive finishes for the others) must
    give the same result in every order and interleaving; the interpreter alone only ever tries the natural order.
    What the interleaving cannot show: a GPU's weaker memory ordering (stores another SM sees late or out of order,
    which the kernels' atomics and barriers must order), and interleavings inside one operation. Raises
    ``RuntimeError`` where Triton's interpreter is not built as expected."""
    if order not in PROGRAM_ORDERS:
        raise ValueError(f"expected an order of {PROGRAM_ORDERS} but got {order!r}")
    undo = _install_order_hooks() if not _ORDERS else None
    _ORDERS.append(_Order(order, seed))
    try:
        yield
    finally:
        _ORDERS.pop()
        if undo is not None:
            undo()
