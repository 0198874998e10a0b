"""CLI polish (issue 15): every flag has help with its default, ``--static FILE``, quiet broken pipes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qada.cli import build_parser, main
from qada.cli.common import HelpFormatter

QADA = Path(sys.executable).with_name("qada")


def subparsers(parser: argparse.ArgumentParser, prefix: str = "qada"):
    """``(command, parser)`` for every subcommand, nested ones (``qada moments build``) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield f"{prefix} {name}", child
                yield from subparsers(child, f"{prefix} {name}")


def required_in_a_group(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    return any(group.required and action in group._group_actions for group in parser._mutually_exclusive_groups)


COMMANDS = dict(subparsers(build_parser()))


def test_every_subcommand_is_walked():
    assert {"qada eval", "qada generate", "qada sweep", "qada moments build", "qada moments info"} <= set(COMMANDS)
    assert len(COMMANDS) == 11


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help_and_shows_its_default(command):
    parser = COMMANDS[command]
    assert parser.formatter_class is HelpFormatter, command
    text = " ".join(parser.format_help().split())  # unwrapped: a default may be broken over two lines
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{command} {flag}: no help text"
        if action.nargs == 0 or action.default is argparse.SUPPRESS:
            continue  # on-off flags and --import (repeatable, nothing by default)
        if action.default is not None:
            assert f"(default: {action.default})" in text, f"{command} {flag}: default {action.default!r} not shown"
        elif action.option_strings and not action.required and not required_in_a_group(parser, action):
            # None: the help says in words what happens without the flag
            assert "(default: " in action.help, f"{command} {flag}: the help does not say what the default is"


def test_help_texts_have_no_old_style_defaults():
    for command, parser in COMMANDS.items():
        for action in parser._actions:
            assert "(default " not in (action.help or ""), f"{command} {action.option_strings}: '(default X)'"


def test_sweep_static_takes_known_family_names_only():
    parser = build_parser()
    base = ["sweep", "--out", "o"]
    assert parser.parse_args(base).static == ("static_oracle", "static_ruler")
    assert parser.parse_args([*base, "--static", "static_ruler"]).static == ("static_ruler",)
    assert parser.parse_args([*base, "--static", ""]).static == ()
    from qada.cli.sweep import static_families

    with pytest.raises(argparse.ArgumentTypeError, match="unknown static family 'bogus'; expected some of"):
        static_families("static_oracle,bogus")


def _mask_file(tmp_path: Path, model_dir: Path) -> Path:
    from transformers import AutoConfig

    from qada.artifacts import model_fingerprint, save_head_mask

    config = AutoConfig.from_pretrained(model_dir)
    mask = torch.zeros(config.num_hidden_layers, config.num_attention_heads, dtype=torch.bool)
    mask[:, : config.num_attention_heads // 2] = True  # half the heads of every layer local
    return save_head_mask(tmp_path / "mask.safetensors", mask, model_fingerprint(config), info={"alpha": 0.5})


def test_generate_static_uses_the_mask_of_the_file(tiny_model_dir, tmp_path, capsys):
    path, _ = tiny_model_dir
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The pass key is 12345. " * 40 + "What is the pass key? The pass key is")
    mask = _mask_file(tmp_path, path)
    assert main(["generate", "--prompt-file", str(prompt), "--model", str(path), "--static", str(mask),
                 "--t-local", "64", "--t-sink", "4", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert f"criterion: static {mask} (4 of 8 heads local)" in out
    assert "sparsity: 0.500" in out


def test_eval_takes_static_instead_of_criterion(tmp_path, capsys):
    parser = build_parser()
    mask = tmp_path / "mask.safetensors"
    mask.write_bytes(b"")
    args = parser.parse_args(["eval", "--task", "niah_single_1", "--out", "r.json", "--static", str(mask)])
    assert args.static == str(mask) and args.criterion is None
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["eval", "--task", "t", "--out", "r.json", "--static", str(mask), "--criterion", "qada"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def _clean_env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "default"}


@pytest.mark.parametrize("argv", [["criteria"], ["--help"], ["sweep", "--help"]], ids=" ".join)
def test_a_closed_pipe_ends_quietly(argv):
    """`qada criteria | head -1` through a real shell pipe, and a reader that is gone before the first write."""
    command = " ".join([str(QADA), *argv]) + " | head -1"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True,
                            env=_clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    process = subprocess.Popen([str(QADA), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_clean_env())
    process.stdout.close()  # nobody reads: every write fails with EPIPE
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipeError" not in err, err


def test_building_the_reference_says_so_once(tmp_path, capsys):
    from qada.moments.reference import load_or_build_reference
    from tests.test_moments_stored import WordTokenizer, tiny_llama

    model = tiny_llama()
    load_or_build_reference(model, WordTokenizer(), length=120, seed=1, cache_dir=tmp_path, chunk_size=50)
    err = capsys.readouterr().err
    assert err.count("qada: building the stored-moment reference (random_words, 120 tokens) once; cached at") == 1
    assert str(tmp_path) in err
    load_or_build_reference(model, WordTokenizer(), length=120, seed=1, cache_dir=tmp_path, chunk_size=50)
    assert "building" not in capsys.readouterr().err  # cached: loaded quietly


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_second_criterion_is_an_error_not_silently_the_last(command, capsys):
    """argparse keeps the last of a repeated flag; one configuration per command, so the second is refused."""
    args = [command, "--criterion", "qada", "--criterion", "dense", "--model", "nowhere"]
    args += ["--task", "niah_single_1"] if command == "eval" else ["--prompt", "hi"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--criterion given twice" in err and "qada sweep --criterion A --criterion B" in err
