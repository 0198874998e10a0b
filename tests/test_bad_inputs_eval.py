"""Bad inputs of evaluation (issue 15): results folders, resume identity, data files, counts, outputs.

Python-API rows run the :class:`~qada.eval.evaluator.Evaluator` on a tiny random Llama with the real SmolLM2
tokenizer; CLI rows fail before the model loads (or use the saved tiny model). Faults that need their own set-up
(a second process, a full disk, a kill during a write) have their own tests below, named in ``OTHER_KINDS``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import pytest

from qada.eval.configs import EvalConfig
from qada.eval.evaluator import Evaluator
from qada.eval.identity import ResultsMismatchError
from qada.eval.results_file import ResultsFile, ResultsLockedError
from tests.bad_inputs import Case, CliCase, check_case, check_cli_case, ids

WINDOW = {"t_local": 64, "t_sink": 4}


@lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory

    return AutoTokenizer.from_pretrained(model_directory(None))


@lru_cache(maxsize=4)
def model(seed: int = 0, **overrides):
    from tests.tiny_models import tiny_model

    return tiny_model("llama", seed=seed, vocab_size=len(tokenizer()), **dict(overrides))


@lru_cache(maxsize=4)
def samples(seed: int = 0, n: int = 1):
    from qada.eval.tasks import TASKS

    return tuple(TASKS.build("niah_single_1").generate(tokenizer(), 200, n, seed=seed))


def qada_config(tau: float = 0.3, executor: str = "sdpa", label: str = "qada") -> EvalConfig:
    return EvalConfig(label, {"name": "qada", "tau": tau}, "current", executor, WINDOW, "qada/current")


def evaluate(folder, configs=None, the_model=None, the_samples=None, seed=0, record_oracle=False):
    evaluator = Evaluator(the_model or model(), tokenizer(), configs or [qada_config()], folder,
                          record_oracle=record_oracle, progress=False, settings={"seed": seed})
    return evaluator.evaluate(list(samples() if the_samples is None else the_samples))


def rerun(first: dict, second: dict):
    """Evaluate twice in the same folder: the second run's keyword arguments differ from the first's."""
    def run(tmp_path):
        evaluate(tmp_path, **first)
        return evaluate(tmp_path, **second)

    return run


def changed_sample(tmp_path):
    sample = samples()[0]
    evaluate(tmp_path, the_samples=[sample])
    other = type(sample)(**{**sample.__dict__, "input": sample.input.replace("The", "the", 1) + " "})
    evaluate(tmp_path, the_samples=[other])


def changed_version(tmp_path, monkeypatch=None):
    import qada.version

    evaluate(tmp_path)
    before = qada.version.__version__
    qada.version.__version__ = before + ".post1"
    try:
        evaluate(tmp_path)
    finally:
        qada.version.__version__ = before


def old_rows(tmp_path):
    evaluate(tmp_path)
    path = tmp_path / "results-rank0.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "run"}) + "\n" for r in rows))
    evaluate(tmp_path)


def corrupted_middle_line(tmp_path):
    evaluate(tmp_path, the_samples=samples(n=2))
    path = tmp_path / "results-rank0.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0][:20] + "\n" + "\n".join(lines[1:]) + "\n")
    evaluate(tmp_path, the_samples=samples(n=2))


def non_object_line(tmp_path):
    (tmp_path / "results-rank0.jsonl").write_text("[1, 2]\n")
    evaluate(tmp_path)


def row_missing_fields(tmp_path):
    (tmp_path / "results-rank0.jsonl").write_text('{"sample": "niah_single_1/200/base/0"}\n')
    evaluate(tmp_path)


def artifact_changed(tmp_path):
    """Stored moments read from a reference file: the same spec, another file content."""
    import torch

    from qada.moments.reference import collect_reference_keys

    path = tmp_path / "ref.safetensors"
    config = EvalConfig("stored", {"name": "qada", "tau": 0.3}, {"name": "stored", "path": str(path), "offset": 32},
                        "sdpa", WINDOW, "qada/stored")
    for seed in (0, 1):
        ids = torch.randint(0, 1000, (1, 320), generator=torch.Generator().manual_seed(seed))
        collect_reference_keys(model(), ids, chunk_size=None).save(path)
        evaluate(tmp_path / "out", configs=[config])


def one_token_answers(tmp_path):
    sample = samples()[0]
    short = type(sample)(**{**sample.__dict__, "outputs": [""], "tokens_to_generate": 1})
    return evaluate(tmp_path, the_samples=[short])["qada"], (tmp_path / "results-rank0.jsonl")


def check_one_token(result):
    entry, path = result
    assert entry["sparsity"] is None and "no decode step ran" in entry["missing"]["sparsity"]
    json.dumps(entry, allow_nan=False)  # valid JSON: no NaN anywhere
    json.loads(path.read_text().splitlines()[0])


def added_config(tmp_path):
    evaluate(tmp_path)
    return evaluate(tmp_path, configs=[qada_config(), qada_config(0.5, label="qada tau=0.5")])


def check_added(result):
    assert set(result) == {"qada", "qada tau=0.5"} and result["qada tau=0.5"]["score"] is not None


def write_jsonl(lines):
    def run(tmp_path):
        from qada.eval.tasks import load_ruler_jsonl

        path = tmp_path / "data.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        return load_ruler_jsonl(path)

    return run


GOOD = '{"input": "x", "outputs": ["1"]}'

CASES = [
    # resume: any changed setting is refused, never mixed
    Case("eval_resume_other_seed", rerun({}, {"seed": 1}), ResultsMismatchError, r"settings\.seed: 0 -> 1"),
    Case("eval_resume_other_model_weights", rerun({}, {"the_model": model(1)}), ResultsMismatchError,
         r"model\.weights"),
    Case("eval_resume_other_model_size", rerun({}, {"the_model": model(0, num_hidden_layers=3)}),
         ResultsMismatchError, r"model\.num_layers: 2 -> 3"),
    Case("eval_resume_other_executor", rerun({}, {"configs": [qada_config(executor="reference")]}),
         ResultsMismatchError, r"'qada' was run with other parameters.*executor: \"sdpa\" -> \"reference\""),
    Case("eval_resume_other_tau_same_label", rerun({}, {"configs": [qada_config(0.5)]}), ResultsMismatchError,
         r"criterion\.tau: 0\.3 -> 0\.5"),
    Case("eval_resume_record_oracle", rerun({}, {"record_oracle": True}), ResultsMismatchError,
         r"record_oracle: false -> true"),
    Case("eval_resume_changed_sample", changed_sample, ResultsMismatchError, r"had another prompt or answer"),
    Case("eval_resume_other_qada_version", changed_version, ResultsMismatchError, r"versions\.qada"),
    Case("eval_resume_rows_without_identity", old_rows, ResultsMismatchError, r"without a run identity"),
    Case("eval_resume_artifact_changed", artifact_changed, ResultsMismatchError, r"artifacts"),
    Case("eval_resume_added_config", added_config, check=check_added),
    # the results file itself
    Case("eval_results_corrupted_middle_line", corrupted_middle_line, ValueError, r"line 1: not a JSON line"),
    Case("eval_results_non_object_line", non_object_line, ValueError, r"line 1: expected a JSON object"),
    Case("eval_results_row_missing_fields", row_missing_fields, ValueError,
         r"line 1: a results row without \['config'"),
    Case("eval_summary_without_decode_steps", one_token_answers, check=check_one_token),
    # samples
    Case("eval_no_samples", lambda tmp: evaluate(tmp, the_samples=()), ValueError,
         r"at least one sample"),
    Case("eval_duplicate_samples", lambda tmp: evaluate(tmp, the_samples=samples() * 2), ValueError,
         r"unique samples"),
    Case("eval_prompt_longer_than_positions",
         lambda tmp: evaluate(tmp, the_model=model(0, max_position_embeddings=128)), ValueError,
         r"needs \d+ positions .* the model has 128"),
    # data files
    Case("data_empty_file", write_jsonl([]), ValueError, r"holds no samples"),
    Case("data_blank_lines_only", write_jsonl(["", "  "]), ValueError, r"holds no samples"),
    Case("data_bad_json", write_jsonl([GOOD, "{input"]), ValueError, r"line 2: not valid JSON"),
    Case("data_not_an_object", write_jsonl(["[1]"]), ValueError, r"line 1: expected a JSON object"),
    Case("data_missing_input", write_jsonl(['{"outputs": ["1"]}']), ValueError, r"line 1: .*'input'"),
    Case("data_outputs_not_a_list", write_jsonl(['{"input": "x", "outputs": 3}']), ValueError,
         r"line 1: expected 'outputs'"),
    Case("data_duplicate_index", write_jsonl(['{"input": "x", "outputs": ["1"], "index": 4}',
                                              '{"input": "y", "outputs": ["1"], "index": 4}']), ValueError,
         r"line 2: index 4 appears twice \(first on line 1\)"),
    Case("data_negative_index", write_jsonl(['{"input": "x", "outputs": ["1"], "index": -1}']), ValueError,
         r"line 1: expected 'index' to be an integer >= 0"),
    Case("data_string_index", write_jsonl(['{"input": "x", "outputs": ["1"], "index": "a"}']), ValueError,
         r"line 1: expected 'index'"),
    Case("data_zero_answer_budget", write_jsonl(['{"input": "x", "outputs": ["1"], "tokens_to_generate": 0}']),
         ValueError, r"line 1: expected 'tokens_to_generate' to be an integer >= 1"),
    Case("data_path_is_a_folder", lambda tmp: __import__("qada.eval.tasks", fromlist=["x"]).load_ruler_jsonl(tmp),
         IsADirectoryError, r"is a folder"),
    # sweeps from Python
    Case("sweep_unknown_static_family",
         lambda tmp: __import__("qada.eval.sweep", fromlist=["x"]).run_sweep(
             model(), tokenizer(), ["niah_single_1"], [200], 1, tmp, static=("static_bogus",)),
         ValueError, r"unknown static family \['static_bogus'\]"),
    Case("sweep_zero_samples",
         lambda tmp: __import__("qada.eval.sweep", fromlist=["x"]).run_sweep(
             model(), tokenizer(), ["niah_single_1"], [200], 0, tmp), ValueError, r"num_samples .* >= 1"),
    Case("sweep_length_beyond_positions",
         lambda tmp: __import__("qada.eval.sweep", fromlist=["x"]).run_sweep(
             model(0, max_position_embeddings=128), tokenizer(), ["niah_single_1"], [4096], 1, tmp),
         ValueError, r"length 4096 leaves no room .* 128 positions"),
    Case("sweep_unknown_task",
         lambda tmp: __import__("qada.eval.sweep", fromlist=["x"]).run_sweep(
             model(), tokenizer(), ["niah_single_9"], [200], 1, tmp), ValueError, r"unknown task 'niah_single_9'"),
    # summaries
    Case("summary_nan_written_as_null",
         lambda tmp: json.loads(__import__("qada.eval.results_file", fromlist=["x"]).write_json(
             tmp / "s.json", {"sparsity": float("nan"), "x": [float("inf")]}).read_text()),
         check=lambda value: value == {"sparsity": None, "x": [None]}),
    Case("table_with_missing_values",
         lambda tmp: __import__("qada.eval.report", fromlist=["x"]).format_table([{
             "task": "t", "length": 1, "n": 1, "label": "qada", "score": 50.0, "sparsity": None,
             "kv_sparsity": None}]),
         check=lambda text: text.splitlines()[-1].split()[-3:] == ["50.0", "-", "-"]),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_bad_input(case, tmp_path):
    check_case(case, tmp_path)


def data_file(tmp, text: str) -> Path:
    path = tmp / "data.jsonl"
    path.write_text(text)
    return path


def _eval(tmp, *extra):
    return ["eval", "--task", "niah_single_1", "--length", "256", "--samples", "1", "--out", tmp / "r.json", *extra]


CLI_CASES = [
    CliCase("cli_eval_out_is_a_folder", lambda tmp: _eval(tmp)[:-1] + [tmp], r"--out .* is a folder"),
    CliCase("cli_eval_out_under_a_file",
            lambda tmp: (tmp / "f").write_text("") or _eval(tmp)[:-1] + [tmp / "f" / "r.json"],
            r"is a file, not a folder"),
    CliCase("cli_eval_out_unwritable", lambda tmp: _eval(tmp)[:-1] + ["/sys/qada/r.json"], r"cannot write in '/sys'"),
    CliCase("cli_eval_zero_samples", lambda tmp: _eval(tmp, "--samples", "0"), r"--samples.*>= 1 but got 0"),
    CliCase("cli_eval_negative_samples", lambda tmp: _eval(tmp, "--samples", "-1"), r"--samples.* got -1"),
    CliCase("cli_eval_zero_length", lambda tmp: _eval(tmp, "--length", "0"), r"--length.*>= 1 but got 0"),
    CliCase("cli_eval_empty_data_file",
            lambda tmp: ["eval", "--data", data_file(tmp, ""), "--out", tmp / "r.json"], r"holds no samples"),
    CliCase("cli_eval_data_duplicate_index",
            lambda tmp: ["eval", "--data", data_file(tmp, (GOOD[:-1] + ', "index": 0}\n') * 2), "--out",
                         tmp / "r.json"], r"line 2: index 0 appears twice"),
    CliCase("cli_eval_data_missing", lambda tmp: ["eval", "--data", tmp / "none.jsonl", "--out", tmp / "r.json"],
            r"does not exist"),
    CliCase("cli_eval_output_locked",
            lambda tmp: _hold_lock(tmp / "r.parts" / "results-rank0.jsonl") and _eval(tmp),
            r"another process \(pid \d+\) is writing", code=1),
    CliCase("cli_sweep_zero_samples", lambda tmp: ["sweep", "--samples", "0", "--out", tmp / "s"],
            r"--samples.*>= 1 but got 0"),
    CliCase("cli_sweep_out_is_a_file",
            lambda tmp: (tmp / "f").write_text("") or ["sweep", "--out", tmp / "f"], r"--out .* is a file"),
    CliCase("cli_sweep_unknown_task", lambda tmp: ["sweep", "--tasks", "nope", "--out", tmp / "s"],
            r"unknown task 'nope'"),
    CliCase("cli_sweep_bad_lengths", lambda tmp: ["sweep", "--lengths", "2k", "--out", tmp / "s"],
            r"--lengths to be comma-separated integers"),
    CliCase("cli_sweep_bad_moment_parameter",
            lambda tmp: ["sweep", "--moments", "stored:prompt=bogus", "--out", tmp / "s"], r"expected prompt in"),
    CliCase("cli_sweep_tau_out_of_range", lambda tmp: ["sweep", "--taus", "0.5,1.5", "--out", tmp / "s"], r"tau"),
    CliCase("cli_calibrate_out_is_a_folder",
            lambda tmp: ["calibrate", "--tasks", "niah_single_1", "--out", tmp], r"--out .* is a folder"),
    CliCase("cli_calibrate_unknown_task",
            lambda tmp: ["calibrate", "--tasks", "niah_single_1,nope", "--out", tmp / "m.safetensors"],
            r"unknown task 'nope'"),
    CliCase("cli_calibrate_alpha_above_one",
            lambda tmp: ["calibrate", "--tasks", "niah_single_1", "--alpha", "1.5", "--out", tmp / "m.safetensors"],
            r"--alpha in \[0, 1\] but got 1.5"),
    CliCase("cli_calibrate_empty_data",
            lambda tmp: ["calibrate", "--data", data_file(tmp, ""), "--out", tmp / "m.safetensors"],
            r"holds no samples"),
    CliCase("cli_analyze_out_is_a_file",
            lambda tmp: (tmp / "f").write_text("") or ["analyze", "--task", "niah_single_2", "--out", tmp / "f"],
            r"--out .* is a file"),
    CliCase("cli_analyze_unknown_task", lambda tmp: ["analyze", "--task", "nope", "--out", tmp / "a"],
            r"unknown task 'nope'"),
    CliCase("cli_demo_zero_samples", lambda tmp: ["demo", "--samples", "0", "--out", tmp / "d"],
            r"--samples.*>= 1 but got 0"),
    CliCase("cli_demo_out_is_a_file",
            lambda tmp: (tmp / "f").write_text("") or ["demo", "--out", tmp / "f"], r"--out .* is a file"),
]

_HELD: list[ResultsFile] = []


def _hold_lock(path: Path) -> bool:
    """Hold ``path``'s lock in this process (another open file description: flock conflicts as with a process)."""
    held = ResultsFile(path)
    held.acquire()
    _HELD.append(held)
    return True


@pytest.mark.parametrize("case", CLI_CASES, ids=ids(CLI_CASES))
def test_bad_cli_input(case, tmp_path, capsys):
    try:
        check_cli_case(case, tmp_path, capsys)
    finally:
        while _HELD:
            _HELD.pop().release()


def test_cli_eval_rerun_with_another_seed_is_refused(tmp_path, capsys, tiny_model_dir):
    from tests.bad_inputs import assert_clean_cli_error, run_cli

    path, _ = tiny_model_dir
    argv = ["eval", "--task", "niah_single_1", "--length", "200", "--samples", "1", "--model", path,
            "--criterion", "oracle", "--tau", "0.3", "--out", tmp_path / "r.json"]
    first = run_cli(argv, capsys)
    assert first.code == 0, first.err
    assert json.loads((tmp_path / "r.json").read_text())["run"]
    assert_clean_cli_error(run_cli([*argv, "--seed", "1"], capsys), r"Changed: settings\.seed: 0 -> 1")
    assert_clean_cli_error(run_cli([*argv[:-2], "--length", "256", "--out", argv[-1]], capsys),
                           r"settings\.data\.length: 200 -> 256")


# --- faults -------------------------------------------------------------------------------------------------------
OTHER_KINDS = {
    "fault_second_process_same_output": "test_a_second_process_gets_a_clear_error",
    "fault_disk_full_during_write": "test_disk_full_keeps_the_file_whole_and_resumes",
    "fault_kill_during_write": "test_a_write_cut_short_is_repaired_and_resumed",
    "fault_kill_at_random_points": "test_killed_twenty_times_then_resumed_equals_uninterrupted",
}


def test_a_second_process_gets_a_clear_error(tmp_path):
    path = tmp_path / "results-rank0.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from qada.eval.results_file import ResultsFile
        with ResultsFile({str(path)!r}):
            print("held", flush=True)
            sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ResultsLockedError, match=rf"another process \(pid {holder.pid}\) is writing"):
            evaluate(tmp_path)
        assert not path.read_text(), "the refused process wrote nothing"
    finally:
        holder.communicate("\n", timeout=30)
    evaluate(tmp_path)  # the lock is free again once the holder exits
    assert len(path.read_text().splitlines()) == 1


def _all_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results-rank0.jsonl").read_text().splitlines()]


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("seconds", "prefill_seconds")}


def test_disk_full_keeps_the_file_whole_and_resumes(tmp_path, monkeypatch):
    import errno
    import os

    configs = [qada_config(), qada_config(0.5, label="b"), qada_config(0.7, label="c")]
    real_write, calls = os.write, []

    def full_after_one_row(fd, data):
        calls.append(1)
        if len(calls) == 2:  # the second row: half of it reaches the disk, then the disk is full
            real_write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_after_one_row)
    with pytest.raises(OSError, match="the disk is full; the finished rows are kept"):
        evaluate(tmp_path, configs=configs)
    monkeypatch.setattr(os, "write", real_write)
    assert len(_all_rows(tmp_path)) == 1, "the half-written row is rolled back"
    evaluate(tmp_path, configs=configs)
    reference = tmp_path / "reference"
    evaluate(reference, configs=configs)
    assert [_stable(r) for r in _all_rows(tmp_path)] == [_stable(r) for r in _all_rows(reference)]


def test_a_write_cut_short_is_repaired_and_resumed(tmp_path, monkeypatch):
    import os

    configs = [qada_config(), qada_config(0.5, label="b")]
    real_write, calls = os.write, []

    class Killed(BaseException):
        """Stands for SIGKILL between two system calls: nothing after it runs (no rollback)."""

    def killed_mid_row(fd, data):
        calls.append(1)
        if len(calls) == 2:
            real_write(fd, data[: len(data) // 3])
            raise Killed
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", killed_mid_row)
    with pytest.raises(Killed):
        evaluate(tmp_path, configs=configs)
    monkeypatch.setattr(os, "write", real_write)
    assert not (tmp_path / "results-rank0.jsonl").read_text().endswith("\n"), "a torn last line was left"
    with pytest.warns(UserWarning, match="removed a torn last line"):
        evaluate(tmp_path, configs=configs)
    reference = tmp_path / "reference"
    evaluate(reference, configs=configs)
    assert [_stable(r) for r in _all_rows(tmp_path)] == [_stable(r) for r in _all_rows(reference)]


@pytest.mark.slow
def test_killed_twenty_times_then_resumed_equals_uninterrupted(tmp_path, tiny_model_dir):
    """SIGKILL ``qada eval`` at random points 20 times (each kill lands while it evaluates), then let it finish:
    the per-sample rows and the scores equal an uninterrupted run's."""
    import os
    import random
    import signal
    import time

    path, _ = tiny_model_dir
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(out):
        return [sys.executable, "-m", "qada", "eval", "--task", "niah_single_1", "--length", "160", "--samples",
                "30", "--model", str(path), "--criterion", "qada", "--tau", "0.3", "--moments", "current",
                "--out", str(out)]

    reference = tmp_path / "reference.json"
    subprocess.run(command(reference), check=True, env=environment, capture_output=True, timeout=600)
    rows_path = tmp_path / "killed.parts" / "results-rank0.jsonl"
    lock = rows_path.with_name(rows_path.name + ".lock")
    rng = random.Random(0)
    kills, attempts = 0, 0
    while kills < 20:
        attempts += 1
        assert attempts < 60, f"only {kills} kills landed during evaluation in {attempts} attempts"
        before = rows_path.read_text().count("\n") if rows_path.exists() else 0
        process = subprocess.Popen(command(tmp_path / "killed.json"), env=environment, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().strip() == str(process.pid)) and time.monotonic() < deadline:
            if process.poll() is not None:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.25))  # a random point inside the evaluation
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
            kills += 1
        else:
            assert process.returncode == 0
            break  # finished before a kill: nothing left to interrupt
        assert rows_path.read_text().count("\n") >= before, "finished rows are never lost"
    finish = subprocess.run(command(tmp_path / "killed.json"), env=environment, capture_output=True, text=True,
                            timeout=600)
    assert finish.returncode == 0, finish.stderr
    assert kills == 20
    killed_rows = sorted((_stable(r) for r in _all_rows(tmp_path / "killed.parts")), key=lambda r: r["sample"])
    reference_rows = sorted((_stable(r) for r in _all_rows(tmp_path / "reference.parts")),
                            key=lambda r: r["sample"])
    assert killed_rows == reference_rows
    summary, expected = (json.loads(p.read_text()) for p in (tmp_path / "killed.json", reference))
    for key in ("score", "sparsity", "kv_sparsity", "n", "run"):
        assert summary[key] == expected[key]


def test_cli_eval_static_file(tmp_path, capsys, tiny_model_dir):
    """``qada eval --static FILE``: a head mask made for the model is evaluated as the static criterion; a mask made
    for another model is refused before any sample runs."""
    import torch
    from transformers import AutoConfig

    from qada.artifacts import model_fingerprint, save_head_mask
    from tests.bad_inputs import assert_clean_cli_error, run_cli

    path, _ = tiny_model_dir
    from transformers import AutoModelForCausalLM

    the_model = AutoModelForCausalLM.from_pretrained(path)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[:, :2] = True
    mine = save_head_mask(tmp_path / "mine.safetensors", mask, model_fingerprint(the_model.config, the_model))
    argv = ["eval", "--task", "niah_single_1", "--length", "200", "--samples", "1", "--model", path]
    result = run_cli([*argv, "--static", mine, "--out", tmp_path / "r.json"], capsys)
    assert result.code == 0, result.err
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["label"] == "static mine.safetensors" and record["criterion"]["name"] == "static"
    assert record["sparsity"] == pytest.approx(0.5)

    other = AutoConfig.from_pretrained(path)
    other.num_attention_heads, other.num_key_value_heads = 8, 2
    theirs = save_head_mask(tmp_path / "theirs.safetensors", torch.zeros(2, 8, dtype=torch.bool),
                            model_fingerprint(other))
    assert_clean_cli_error(run_cli([*argv, "--static", theirs, "--out", tmp_path / "t.json"], capsys),
                           r"made for another model")
    assert not (tmp_path / "t.parts").exists(), "refused before any work"
