"""The plumbing of ``benchmarks/package_cold.py`` (no timing assertions: it only measures)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``benchmarks`` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.package_cold import BUSY_US, make_cases, spin, time_after, to_markdown  # noqa: E402


def test_time_after_runs_before_each_call_and_times_only_the_call():
    order: list[str] = []
    median = time_after(lambda: (order.append("before"), spin(2000)), lambda: order.append("call"), 3)
    assert order == ["before", "call"] * 3
    assert 0 <= median < 1500  # the 2 ms spent before each call is not counted


def test_spin_keeps_the_thread_busy_for_its_time():
    begin = time.perf_counter()
    spin(3000)
    assert time.perf_counter() - begin >= 3e-3


def test_cases_and_markdown_table():
    cases = make_cases()
    assert {"nothing", "sum 32 MB", "gemv 14 MB", "sleep 1 ms"} <= set(cases)
    assert {f"busy {us} us" for us in BUSY_US} <= set(cases)
    result = {"length": 64, "cpu": "x", "threads": 2, "torch": "t", "load_average": (0.1, 0.2, 0.3), "calls": 5,
              "cases": {"nothing": 200.0, "sum 32 MB": 500.0}}
    table = to_markdown(result, "python benchmarks/package_cold.py")
    assert "| nothing | 200.0 | 1.00 |" in table and "| sum 32 MB | 500.0 | 2.50 |" in table
