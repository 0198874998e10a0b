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


def test_criteria_shows_what_each_criterion_needs(capsys):
    assert main(["criteria"]) == 0
    out = capsys.readouterr().out
    assert out.count("needs: ") == len(CRITERIA.names())
    for needs in ("needs: moments", "needs: full scores", "needs: nothing", "needs: what its criteria need"):
        assert needs in out
    from qada.cli.criteria import needs_of
    from qada.criteria import AnyOf, DenseCriterion, OracleCriterion, QAdACriterion

    assert needs_of(QAdACriterion) == "moments"
    assert needs_of(OracleCriterion) == "full scores"
    assert needs_of(DenseCriterion) == "nothing"
    assert needs_of(AnyOf) == "what its criteria need"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("qada", "qada"),
        (" dense ", "dense"),
        ("layer_override", "layer_override"),
        ("{name: qada, tau: 0.3}", {"name": "qada", "tau": 0.3}),
        ('{"name": "oracle", "tau": 0.2}', {"name": "oracle", "tau": 0.2}),
        ("{name: any_of, criteria: [qada, {name: static, mask: [[true]]}]}",
         {"name": "any_of", "criteria": ["qada", {"name": "static", "mask": [[True]]}]}),
        ("name: not\ncriterion: local\n", {"name": "not", "criterion": "local"}),
    ],
)
def test_parse_component_spec(text, expected):
    from qada.cli.common import parse_component_spec

    assert parse_component_spec(text) == expected


def test_parse_component_spec_files_and_errors(tmp_path):
    from qada.cli.common import parse_component_spec

    (tmp_path / "c.yaml").write_text("name: layer_override\nbase: qada\noverrides: {0: dense}\n")
    (tmp_path / "c.json").write_text('{"name": "not", "criterion": {"name": "oracle", "tau": 0.5}}')
    assert parse_component_spec(str(tmp_path / "c.yaml")) == {"name": "layer_override", "base": "qada",
                                                               "overrides": {0: "dense"}}
    assert parse_component_spec(str(tmp_path / "c.json")) == {"name": "not", "criterion": {"name": "oracle",
                                                                                           "tau": 0.5}}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_component_spec(str(tmp_path / "missing.yml"))
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ValueError, match="expected a YAML/JSON mapping"):
        parse_component_spec(str(tmp_path / "list.yaml"))
    with pytest.raises(ValueError, match="with a 'name' key"):
        parse_component_spec("{tau: 0.3}")
    with pytest.raises(ValueError, match="could not parse"):
        parse_component_spec("{name: qada, tau: [}")
    with pytest.raises(ValueError, match="expected a component name"):
        parse_component_spec("[qada, dense]")
    with pytest.raises(ValueError, match="expected a component name"):
        parse_component_spec("")


def test_build_criterion_adds_tau_to_a_name_only():
    from qada.cli.common import build_criterion

    config, criterion = build_criterion("oracle", 0.3)
    assert config == {"name": "oracle", "tau": 0.3} and criterion.tau == 0.3
    with pytest.raises(ValueError, match="--tau goes with a criterion name"):
        build_criterion({"name": "oracle"}, 0.3)


def test_every_subcommand_takes_import(capsys):
    from qada.cli import SUBCOMMANDS, build_parser

    parser = build_parser()
    for command in SUBCOMMANDS:
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert "--import MODULE" in capsys.readouterr().out, command
    for command in (["moments", "build"], ["moments", "info"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--help"])
        assert "--import MODULE" in capsys.readouterr().out, command
    args = parser.parse_args(["criteria", "--import", "a", "--import", "b"])
    assert args.imports == ["a", "b"]
    args = parser.parse_args(["moments", "--import", "a", "info", "file"])
    assert args.imports == ["a"]


def test_a_failed_import_is_a_clean_error(capsys):
    assert main(["criteria", "--import", "no_such_qada_module"]) == 2
    assert "could not import module 'no_such_qada_module'" in capsys.readouterr().err


def test_eval_out_defaults_to_a_named_file_under_qada_eval():
    import argparse

    from qada.cli.evaluate import default_out

    args = argparse.Namespace(model="gemma3-270m", data=None, task="niah_single_2", length=8192)
    expected = "qada-eval/gemma3-270m-niah_single_2-8192-qada_stored_tau=0.6.json"
    assert default_out(args, "qada/stored tau=0.6") == expected
    args = argparse.Namespace(model=None, data="/a/b/ruler.jsonl", task=None, length=4096)
    assert default_out(args, "dense") == "qada-eval/smollm2-135m-ruler-dense.json"
