"""Rewrite the ``--help`` blocks of ``docs/api/cli.rst`` from the command line's own parsers.

    python scripts/cli_help_docs.py            # rewrite the page in place
    python scripts/cli_help_docs.py --check    # exit 1, naming the stale blocks, where the page differs

Each ``.. code-block:: text`` on the page whose first line is ``usage: qada ...`` is replaced by that command's help
as ``qada <command> --help`` prints it 100 columns wide. ``tests/test_cli_docs.py`` checks that the page is up to
date, so a flag added to a subcommand without rerunning this fails the tests instead of leaving the page behind.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "api" / "cli.rst"
WIDTH = 100
INDENT = "   "

_BLOCK = re.compile(r"(\.\. code-block:: text\n\n)((?:   .*\n|\n)+?)(?=\S|\Z)")
_USAGE = re.compile(r"usage: (qada(?: [a-z]+)*?) (?:\[-h\])")


def help_text(command: str) -> str:
    """``qada <command> --help`` (``command``: ``"qada"``, ``"qada eval"``, ``"qada moments build"``), formatted
    :data:`WIDTH` columns wide."""
    from qada.cli import build_parser

    parser = build_parser()
    for name in command.split()[1:]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        return parser.format_help()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def updated(page: str) -> tuple[str, list[str]]:
    """``(the page with every help block rewritten, the commands whose block changed)``."""
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        body = match.group(2)
        usage = _USAGE.match(body.strip())
        if usage is None:  # a text block that is not a command's help
            return match.group(0)
        command = usage.group(1)
        lines = [INDENT + line if line else "" for line in help_text(command).rstrip("\n").split("\n")]
        new = "\n".join(lines) + "\n" + "\n" * (body.endswith("\n\n"))  # (the blank line after it, if any)
        if new.rstrip() != body.rstrip():
            changed.append(command)
        return match.group(1) + new

    return _BLOCK.sub(replace, page), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only say which blocks are stale (exit 1 if any)")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    new, changed = updated(page)
    if args.check:
        if changed:
            print(f"{PAGE.relative_to(ROOT)}: stale help of {', '.join(changed)}; run python scripts/cli_help_docs.py")
            return 1
        return 0
    if new != page:
        PAGE.write_text(new)
    print(f"rewrote {len(changed)} block(s): {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
