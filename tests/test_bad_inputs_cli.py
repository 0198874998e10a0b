"""Bad command lines (issue 15): each is a usage error, exit status 2, one clear line on stderr, no traceback.

Most are caught while the command line is parsed (argparse types and groups); the others fail before the model
loads, except ``cli_generate_static_other_model``, which needs a model to compare the mask's fingerprint with
(the tiny saved model of ``tests/conftest.py``, linked as ``tmp_path/model``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.bad_inputs import CliCase, check_cli_case, ids


def _file(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _prompt(tmp: Path) -> Path:
    return _file(tmp, "prompt.txt", "The pass key is 12345. What is the pass key?")


def _generate(tmp: Path, *more) -> list:
    return ["generate", "--prompt-file", _prompt(tmp), *more]


def _eval(tmp: Path, *more) -> list:
    return ["eval", "--task", "niah_single_1", "--out", tmp / "r.json", *more]


def _other_model_mask(tmp: Path) -> Path:
    """A head mask made for a 3-layer, 6-head model (the tiny model has 2 layers of 4 heads)."""
    from qada.artifacts import save_head_mask

    fingerprint = {"model_type": "llama", "num_layers": 3, "num_heads": 6, "num_kv_heads": 2, "head_dim": 16,
                   "hidden_size": 96, "max_positions": 4096, "rope": {"rope_theta": 10000.0, "rope_scaling": None}}
    return save_head_mask(tmp / "other.safetensors", torch.zeros(3, 6, dtype=torch.bool), fingerprint)


NEEDS_MODEL = {"cli_generate_static_other_model"}
NO_CUDA = {"cli_device_cuda_without_cuda"}  # run as on a machine without a GPU, wherever the suite runs

CLI_CASES = [
    CliCase("cli_unknown_subcommand", lambda tmp: ["bogus"], r"invalid choice: 'bogus'"),
    CliCase("cli_unknown_option", lambda tmp: ["criteria", "--bogus"], r"unrecognized arguments: --bogus"),
    CliCase("cli_missing_required_flag", lambda tmp: ["sweep", "--tasks", "niah_single_1"],
            r"the following arguments are required: --out"),
    CliCase("cli_exclusive_task_and_data", lambda tmp: _eval(tmp, "--data", _file(tmp, "d.jsonl", "")),
            r"argument --data: not allowed with argument --task"),
    CliCase("cli_bad_choice", lambda tmp: _eval(tmp, "--template", "bogus"),
            r"argument --template: invalid choice: 'bogus'"),
    CliCase("cli_samples_not_a_number", lambda tmp: _eval(tmp, "--samples", "abc"),
            r"argument --samples: expected an integer >= 1 but got 'abc'"),
    CliCase("cli_samples_zero", lambda tmp: _eval(tmp, "--samples", "0"),
            r"argument --samples: expected an integer >= 1 but got 0"),
    CliCase("cli_tau_not_a_number", lambda tmp: _generate(tmp, "--tau", "abc"),
            r"argument --tau: invalid float value: 'abc'"),
    CliCase("cli_max_new_tokens_zero", lambda tmp: _generate(tmp, "--max-new-tokens", "0"),
            r"argument --max-new-tokens: expected an integer >= 1 but got 0"),
    CliCase("cli_moments_build_length_negative",
            lambda tmp: ["moments", "build", "--out", tmp / "k.safetensors", "--length", "-5"],
            r"argument --length: expected an integer >= 1 but got -5"),
    CliCase("cli_sweep_devices_zero", lambda tmp: ["sweep", "--out", tmp / "s", "--devices", "0"],
            r"argument --devices: expected an integer >= 1 but got 0"),
    CliCase("cli_sweep_static_unknown_family", lambda tmp: ["sweep", "--out", tmp / "s", "--static", "bogus"],
            r"argument --static: unknown static family 'bogus'; expected some of static_oracle, static_ruler"),
    CliCase("cli_sweep_taus_not_numbers", lambda tmp: ["sweep", "--out", tmp / "s", "--taus", "0.3,high"],
            r"argument --taus: expected comma-separated numbers but got '0.3,high'"),
    CliCase("cli_prompt_file_missing", lambda tmp: ["generate", "--prompt-file", tmp / "nope.txt"],
            r"argument --prompt-file: file '.*nope\.txt' does not exist"),
    CliCase("cli_generate_static_missing", lambda tmp: _generate(tmp, "--static", tmp / "missing.safetensors"),
            r"argument --static: file '.*missing\.safetensors' does not exist"),
    CliCase("cli_eval_static_missing", lambda tmp: _eval(tmp, "--static", tmp / "missing.safetensors"),
            r"argument --static: file '.*missing\.safetensors' does not exist"),
    CliCase("cli_static_and_criterion",
            lambda tmp: _generate(tmp, "--criterion", "qada", "--static", _file(tmp, "m.safetensors", "")),
            r"argument --static: not allowed with argument --criterion"),
    CliCase("cli_generate_static_not_an_artifact",
            lambda tmp: _generate(tmp, "--static", _file(tmp, "m.safetensors", "not a safetensors file")),
            r"is not a readable safetensors file"),
    CliCase("cli_generate_static_with_tau",
            lambda tmp: _generate(tmp, "--static", _other_model_mask(tmp), "--tau", "0.3"),
            r"--tau goes with a criterion name, not with --static"),
    CliCase("cli_generate_static_other_model",
            lambda tmp: _generate(tmp, "--model", tmp / "model", "--static", _other_model_mask(tmp)),
            r"was made for another model \(.*num_heads: expected 4 but got 6"),
    CliCase("cli_config_missing", lambda tmp: _generate(tmp, "--config", tmp / "run.yaml"),
            r"argument --config: file '.*run\.yaml' does not exist"),
    CliCase("cli_config_is_a_folder", lambda tmp: _generate(tmp, "--config", tmp),
            r"argument --config: expected a file but got the folder"),
    CliCase("cli_config_yaml_list", lambda tmp: _generate(tmp, "--config", _file(tmp, "run.yaml", "- qada\n- local\n")),
            r"expected a YAML mapping .*but got list"),
    CliCase("cli_config_unknown_keys",
            lambda tmp: _generate(tmp, "--config", _file(tmp, "run.yaml", "criterion: qada\ntemperature: 2\n")),
            r"unknown key\(s\) \['temperature'\] in config file"),
    CliCase("cli_criterion_unknown_name", lambda tmp: _generate(tmp, "--criterion", "qadaa"),
            r"unknown criterion 'qadaa'"),
    CliCase("cli_criterion_bad_yaml", lambda tmp: _generate(tmp, "--criterion", "{name: qada, tau: 0.3"),
            r"could not parse the component spec '\{name: qada, tau: 0.3' at line 1"),
    CliCase("cli_criterion_mapping_without_name", lambda tmp: _generate(tmp, "--criterion", "{tau: 0.3}"),
            r"expected a mapping with a 'name' key"),
    CliCase("cli_import_missing_module", lambda tmp: ["criteria", "--import", "no_such_qada_module"],
            r"could not import module 'no_such_qada_module'"),
    CliCase("cli_device_cuda_without_cuda", lambda tmp: _generate(tmp, "--device", "cuda"),
            r"^qada generate: error: --device cuda: CUDA is not available here"),
    CliCase("cli_device_unknown", lambda tmp: _eval(tmp, "--device", "tpu"),
            r"argument --device: expected auto, cpu, cuda or cuda:N but got 'tpu'"),
    CliCase("cli_dtype_unknown", lambda tmp: ["moments", "build", "--out", tmp / "k.safetensors", "--dtype", "int8"],
            r"argument --dtype: invalid choice: 'int8'"),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=ids(CLI_CASES))
def test_bad_cli_input(case, tmp_path, capsys, request):
    if case.kind in NEEDS_MODEL:
        (tmp_path / "model").symlink_to(request.getfixturevalue("tiny_model_dir")[0], target_is_directory=True)
    if case.kind in NO_CUDA:
        request.getfixturevalue("monkeypatch").setattr(torch.cuda, "is_available", lambda: False)
    result = check_cli_case(case, tmp_path, capsys)
    assert len(result.err.strip().splitlines()[-1]) > 0 and result.out == ""
