"""Triton's interpreter with the repeated patching skipped (``qada.attention.interpreter``): the same results, and a
helper called in a kernel's loop patches the language once per kernel run instead of once per call."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter runs on machines without a GPU", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from qada.attention.interpreter import skip_repeated_patching  # noqa: E402


@triton.jit
def _row_max(x_ptr, row, N: tl.constexpr):
    return tl.max(tl.load(x_ptr + row * N + tl.arange(0, N)), axis=0)  # tl.max: a helper that sees tl.core


@triton.jit
def _rows_max_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, N: tl.constexpr):
    for row in tl.static_range(ROWS):
        tl.store(out_ptr + row, _row_max(x_ptr, row, N))


def _run(monkeypatch, rows=8):
    calls = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a, **k: calls.append(1) or original(*a, **k))
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(0))
    out = torch.empty(rows)
    _rows_max_kernel[(1,)](x, out, ROWS=rows, N=16)
    return out, x.amax(1), len(calls)


def test_the_skip_is_installed_once_and_results_are_equal(monkeypatch):
    assert skip_repeated_patching() and skip_repeated_patching()  # idempotent (the suite's conftest installed it)
    out, expected, _ = _run(monkeypatch)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_helpers_patch_once_per_kernel_run_not_once_per_call(monkeypatch):
    skip_repeated_patching()
    _, _, few = _run(monkeypatch, rows=2)
    _, _, many = _run(monkeypatch, rows=16)
    assert many == few > 0  # Triton alone patches again at each of the 2 x rows helper calls
    assert tl.core.is_builtin(tl.program_id) and tl.core.is_builtin(tl.load)  # the kernel's patching was undone
