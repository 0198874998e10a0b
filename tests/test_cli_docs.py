"""The command-line reference (``docs/api/cli.rst``) shows each command's real ``--help``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cli_help_docs", ROOT / "scripts" / "cli_help_docs.py")
cli_help_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli_help_docs)


def test_the_cli_page_shows_every_command_s_current_help():
    page = cli_help_docs.PAGE.read_text()
    new, changed = cli_help_docs.updated(page)
    assert changed == [], f"stale help blocks {changed}: run python scripts/cli_help_docs.py"
    assert new == page


def test_every_subcommand_has_a_help_block():
    from tests.test_cli_help import COMMANDS

    shown = set(re.findall(r"^   usage: (qada(?: [a-z]+)*?) \[-h\]", cli_help_docs.PAGE.read_text(), flags=re.M))
    assert shown == set(COMMANDS) | {"qada"}


def test_a_stale_block_is_found_and_rewritten():
    page = cli_help_docs.PAGE.read_text()
    stale = page.replace("     --no-compile", "     --no-compile-at-all", 1)
    assert stale != page
    new, changed = cli_help_docs.updated(stale)
    assert changed == ["qada criteria"]
    assert new == page
