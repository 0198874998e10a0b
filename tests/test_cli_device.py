"""``--device`` and ``--dtype`` on every subcommand that loads a model (issue 22, item 6: GPU from the command line).

CPU only and fast: a missing GPU is simulated (``torch.cuda.is_available`` patched), the error cases never load a
model (``load_model`` is replaced by one that fails the test), and the real runs use the tiny saved model of
``tests/conftest.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qada.models
import qada.models.loading
from qada.cli import build_parser, main
from qada.cli.common import DTYPES, device_spec, model_placement, resolve_device, resolve_dtype

QADA = Path(sys.executable).with_name("qada")


def _prompt(tmp: Path) -> Path:
    path = tmp / "prompt.txt"
    path.write_text("The pass key is 12345. " * 20 + "What is the pass key? The pass key is")
    return path


#: Every subcommand that loads a model, with the fewest arguments it runs with (outputs under ``tmp``).
MODEL_COMMANDS = {
    "generate": lambda tmp: ["generate", "--prompt-file", _prompt(tmp)],
    "eval": lambda tmp: ["eval", "--task", "niah_single_1", "--out", tmp / "out" / "r.json"],
    "sweep": lambda tmp: ["sweep", "--out", tmp / "out"],
    "demo": lambda tmp: ["demo", "--out", tmp / "out"],
    "calibrate": lambda tmp: ["calibrate", "--tasks", "niah_single_1", "--out", tmp / "out" / "m.safetensors"],
    "analyze": lambda tmp: ["analyze", "--out", tmp / "out"],
    "moments build": lambda tmp: ["moments", "build", "--out", tmp / "out" / "k.safetensors"],
}


def _argv(command: str, tmp: Path, *more: str) -> list[str]:
    return [str(a) for a in MODEL_COMMANDS[command](tmp)] + list(more)


def _error(command: str, message: str) -> str:
    """The one line of a usage error (``qada moments build`` reports as ``qada moments``)."""
    return f"qada {command.split()[0]}: error: {message}"


@pytest.fixture
def no_model(monkeypatch):
    """``load_model`` fails the test: the command must stop before loading the model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(qada.models, "load_model", refuse)
    monkeypatch.setattr(qada.models.loading, "load_model", refuse)


@pytest.fixture
def without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    """As on a machine with one GPU (nothing runs on it: only the checks ask)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


# --- parsing ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [("auto", "auto"), ("cpu", "cpu"), ("cuda", "cuda"),
                                                ("cuda:0", "cuda:0"), ("CUDA:12", "cuda:12"), (" cpu ", "cpu")])
def test_device_values(text, expected):
    assert device_spec(text) == expected


@pytest.mark.parametrize("text", ["tpu", "GPU", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "mps", ""])
def test_bad_device_values(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected auto, cpu, cuda or cuda:N"):
        device_spec(text)


def test_every_model_command_has_the_model_flags(tmp_path):
    """The flags of the one shared helper, defaults ``auto``, on every subcommand that loads a model."""
    parser = build_parser()
    for command in MODEL_COMMANDS:
        args = parser.parse_args([*_argv(command, tmp_path), "--device", "cuda:1", "--dtype", "bfloat16"])
        assert (args.device, args.dtype) == ("cuda:1", "bfloat16"), command
        args = parser.parse_args(_argv(command, tmp_path))
        assert (args.device, args.dtype, args.model) == ("auto", "auto", None), command
    assert not hasattr(parser.parse_args(["moments", "info", "f"]), "device")
    assert parser.parse_args(_argv("moments build", tmp_path)).keys_dtype == "float32"


def test_auto_is_the_cpu_here():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if expected == "cpu":
        assert model_placement(argparse.Namespace(device="auto", dtype="auto")) == (torch.device("cpu"), torch.float32)


def test_auto_follows_cuda(one_gpu):
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda:0")


def test_auto_without_cuda_is_the_cpu(without_cuda):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(("spec", "device", "expected"), [
    ("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16), ("auto", "cuda:1", torch.bfloat16),
    ("float32", "cuda", torch.float32), ("bfloat16", "cpu", torch.bfloat16), ("float16", "cpu", torch.float16),
])
def test_dtype_values(spec, device, expected):
    assert resolve_dtype(spec, torch.device(device)) is expected


def test_the_dtype_choices():
    assert DTYPES == ("auto", "float32", "bfloat16", "float16")
    with pytest.raises(ValueError, match="expected --dtype in auto, float32, bfloat16, float16 but got 'int8'"):
        resolve_dtype("int8", torch.device("cpu"))


# --- a GPU that is not there: one line, exit 2, before the model loads -------------------------------------------
@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_cuda_without_cuda_is_one_line_and_exit_2(command, tmp_path, capsys, without_cuda, no_model):
    assert main(_argv(command, tmp_path, "--device", "cuda")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [_error(command, "--device cuda: CUDA is not available here "
                                                "(torch.cuda.is_available() is False); use --device cpu or auto")]
    assert not (tmp_path / "out").exists()  # no work either: no output folder


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_a_gpu_index_that_does_not_exist_is_one_line_and_exit_2(command, tmp_path, capsys, one_gpu, no_model):
    assert main(_argv(command, tmp_path, "--device", "cuda:1", "--dtype", "float16")) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [_error(command, "--device cuda:1: there is no such GPU; this machine has 1 "
                                                "(cuda:0 to cuda:0)")]


def test_commands_without_a_model_need_no_gpu(tmp_path, capsys, without_cuda, no_model):
    """``sweep --report-only`` and ``analyze --compare`` read results only: ``--device`` does not matter there."""
    code = main(["sweep", "--report-only", "--out", str(tmp_path), "--device", "cuda"])
    assert code == 2 and "no results-rank*.jsonl under" in capsys.readouterr().err
    results = tmp_path / "results.json"
    results.write_text("not JSON")
    code = main(["analyze", "--compare", str(results), "--out", str(tmp_path / "c"), "--device", "cuda"])
    assert code == 2 and "is not JSON" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_from_the_shell(tmp_path):
    result = subprocess.run([str(QADA), *_argv("generate", tmp_path, "--device", "cuda")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == ["qada generate: error: --device cuda: CUDA is not available here "
                                          "(torch.cuda.is_available() is False); use --device cpu or auto"]


# --- sweep: --device with --devices --------------------------------------------------------------------------------
def test_sweep_fabric_devices(monkeypatch):
    from qada.cli.sweep import fabric_devices

    assert fabric_devices(torch.device("cpu"), 2) == ("cpu", 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert fabric_devices(torch.device("cuda"), 2) == ("cuda", 2)
    assert fabric_devices(torch.device("cuda:1"), 1) == ("cuda", [1])
    with pytest.raises(ValueError, match="--device cuda:1 names one GPU but --devices is 2; give --device cuda"):
        fabric_devices(torch.device("cuda:1"), 2)
    with pytest.raises(ValueError, match="expected --devices <= the 2 GPU\\(s\\) here but got 3"):
        fabric_devices(torch.device("cuda"), 3)


def test_sweep_more_processes_than_gpus_fails_before_work(tmp_path, capsys, one_gpu, no_model):
    assert main(_argv("sweep", tmp_path, "--device", "cuda", "--devices", "2")) == 2
    assert capsys.readouterr().err.splitlines() == [
        "qada sweep: error: expected --devices <= the 1 GPU(s) here but got 2"]
    assert not (tmp_path / "out").exists()


# --- real runs on the CPU: the dtype asked for is the dtype used ------------------------------------------------
@pytest.fixture
def loaded(monkeypatch):
    """The (model, dtype, device) of every ``load_model`` call, loading for real."""
    calls = []
    real = qada.models.loading.load_model

    def spy(*args, **kwargs):
        model, tokenizer = real(*args, **kwargs)
        calls.append((model, kwargs.get("dtype"), kwargs.get("device")))
        return model, tokenizer

    monkeypatch.setattr(qada.models, "load_model", spy)
    monkeypatch.setattr(qada.models.loading, "load_model", spy)
    return calls


@pytest.mark.parametrize(("flags", "expected"), [([], torch.float32), (["--dtype", "bfloat16"], torch.bfloat16)])
def test_generate_loads_the_dtype_asked_for(flags, expected, tiny_model_dir, tmp_path, capsys, loaded):
    path, _ = tiny_model_dir
    argv = _argv("generate", tmp_path, "--model", str(path), "--device", "cpu", *flags, "--criterion", "dense",
                 "--max-new-tokens", "2")
    assert main(argv) == 0, capsys.readouterr().err
    [(model, dtype, device)] = loaded
    assert (dtype, device) == (expected, torch.device("cpu"))
    assert model.dtype == expected and model.device.type == "cpu"
    assert "new tokens: 2" in capsys.readouterr().out


def test_eval_records_the_dtype_and_device_used(tiny_model_dir, tmp_path, capsys, loaded):
    path, _ = tiny_model_dir
    out = tmp_path / "r.json"
    argv = ["eval", "--task", "niah_single_1", "--length", "200", "--samples", "1", "--criterion", "dense",
            "--model", str(path), "--device", "cpu", "--dtype", "bfloat16", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    assert loaded[0][0].dtype == torch.bfloat16
    record = json.loads(out.read_text())
    identity = json.loads((tmp_path / "r.parts" / "identities-rank0.json").read_text())[record["run"]]
    assert (identity["dtype"], identity["device"]) == ("torch.bfloat16", "cpu")


def test_the_evaluator_follows_the_model_device():
    """Without a Fabric, the evaluator's process is on the model's device, and the identity says where it ran."""
    from qada.eval.evaluator import Evaluator, model_device
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    assert model_device(model) == torch.device("cpu")
    assert model_device(torch.nn.Module()) == torch.device("cpu")
    evaluator = Evaluator(model, None, [], "unused", progress=False)
    assert evaluator.device == evaluator.fabric.device == torch.device("cpu")
    assert evaluator.identity(set())["device"] == "cpu"
