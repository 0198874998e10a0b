"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) without its repeated language patching.

The interpreter runs a kernel by patching ``triton.language`` with numpy versions of its builtins, then calling the
kernel once per program. It patches again at every call of a ``@triton.jit`` helper inside the kernel, although the
kernel's own patching already holds: the patching does not depend on the function, only on which of
``triton.language`` / ``triton.language.core`` its globals see, and Triton does not undo a helper's patching when
the helper returns. qada's kernels call small helpers in their loops: on the fused kernels' tests that repeated
patching is about 40% of the interpreter's time (1,103 s against 642 s of test time without it).

:func:`skip_repeated_patching` makes a helper's call skip it when the running kernel (or a helper before it) has
patched what the helper sees; a helper that sees more is patched as before. Results are the same; only time
changes. Nothing is changed at import: the test suite and ``benchmarks/run.py --gpu --dry-run`` call it.
"""

from __future__ import annotations

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
