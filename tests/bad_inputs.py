"""The bad-input suite's table format: one :class:`Case` per kind of bad or unusual input.

Each ``tests/test_bad_inputs_*.py`` module holds a ``CASES`` list and runs it with :func:`check_case`;
``tests/test_bad_inputs_count.py`` counts the kinds over all modules (issue 15 asks for at least 66).

A case either expects a clear error (an exception of type ``error`` whose message matches ``match``) or a
correct behaviour (``error is None``: ``run`` returns and ``check`` asserts what it returned). CLI cases run
``qada.cli.main`` in-process and expect an exit code and a one-line message on stderr, never a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["Case", "CliCase", "CliResult", "assert_clean_cli_error", "check_case", "check_cli_case", "ids", "run_cli"]


@dataclass(frozen=True)
class Case:
    """One kind of bad input.

    Attributes:
        kind: a short unique name (the test id).
        run: performs the input; gets pytest's ``tmp_path`` (a fresh folder) and returns anything.
        error: the exception type expected, or ``None`` when the input must be handled correctly.
        match: a regular expression the error message (or, for CLI cases, stderr) must contain.
        check: for ``error is None``: asserts on ``run``'s return value.
    """

    kind: str
    run: Callable[[Any], Any]
    error: type[BaseException] | None = None
    match: str = ""
    check: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class CliCase:
    """One kind of bad command line: ``argv(tmp_path)`` gives the arguments after ``qada``; the run must exit
    with ``code`` and print a one-line message matching ``match`` on stderr, without a traceback."""

    kind: str
    argv: Callable[[Any], Sequence[Any]]
    match: str
    code: int = 2


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


def run_cli(argv: Sequence[str], capsys: Any) -> CliResult:
    """``qada argv`` in-process: its exit code and captured output (a SystemExit from argparse included)."""
    from qada.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return CliResult(code, captured.out, captured.err)


def assert_clean_cli_error(result: CliResult, match: str, code: int = 2) -> None:
    """A usage error: exit ``code``, a message matching ``match`` on stderr, no traceback."""
    assert result.code == code, f"exit code {result.code}, stderr: {result.err}"
    assert "Traceback" not in result.err, result.err
    assert re.search(match, result.err), f"{match!r} not in stderr: {result.err}"


def check_case(case: Case, tmp_path: Any) -> None:
    """Run one case: the expected clear error, or the expected behaviour; never a different exception."""
    if case.error is None:
        result = case.run(tmp_path)
        if case.check is not None:
            case.check(result)
        return
    with pytest.raises(case.error) as raised:
        case.run(tmp_path)
    message = str(raised.value)
    assert "\n" not in message.strip() or case.match == "", f"expected a one-line message but got {message!r}"
    assert re.search(case.match, message), f"{case.match!r} not in {message!r}"


def check_cli_case(case: CliCase, tmp_path: Any, capsys: Any) -> CliResult:
    result = run_cli(case.argv(tmp_path), capsys)
    assert_clean_cli_error(result, case.match, case.code)
    return result


def ids(cases: Sequence[Case]) -> list[str]:
    names = [c.kind for c in cases]
    duplicates = {n for n in names if names.count(n) > 1}
    assert not duplicates, f"duplicate kinds: {duplicates}"
    return names
