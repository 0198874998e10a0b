import subprocess
import sys

import pytest

from qada.cli import main
from qada.criteria import CRITERIA


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("criteria", "demo"):
        assert command in out


def test_criteria_lists_every_criterion_with_parameters(capsys):
    assert main(["criteria"]) == 0
    out = capsys.readouterr().out
    for name in CRITERIA.names():
        assert name in out
    assert "tau: float = 0.6" in out


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "qada", "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("qada ")
