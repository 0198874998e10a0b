"""The RULER jsonl importer, on a file written by RULER's own generator (run offline) and on hand-made lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from qada.eval.tasks import TASKS, count_tokens, load_ruler_jsonl, save_ruler_jsonl, score
from qada.eval.tasks.data import ruler_path

# RULER's generators import ``tenacity`` (only for its Gemini tokenizer's retry decorator), which is not
# installed here: a no-op stand-in is put on the path of the subprocess.
TENACITY_STUB = """
def retry(*args, **kwargs):
    return lambda f: f
def stop_after_attempt(*args): return None
def wait_fixed(*args): return 0
def wait_random(*args): return 0
"""

# One line of RULER's niah_single_1 output (prepare.py, base template, SmolLM2 tokenizer), haystack shortened.
NIAH_LINE = {
    "index": 0,
    "input": "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the number afterwards.\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There "
    "and back again.\nOne of the special magic numbers for determined-envelope is: 4612365.\nThe grass is green. "
    "The sky is blue. The sun is yellow. Here we go. There and back again.\nWhat is the special magic number for "
    "determined-envelope mentioned in the provided text? The special magic number for determined-envelope "
    "mentioned in the provided text is",
    "outputs": ["4612365"],
    "length": 963,
}


@pytest.fixture(scope="module")
def tokenizer_dir():
    from qada.models.loading import model_directory

    return model_directory(None)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_reads_a_file_from_rulers_own_generator(tmp_path, tokenizer_dir, tokenizer):
    """RULER's prepare.py + variable_tracking.py, run as RULER runs them, produce a jsonl that imports."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "tenacity.py").write_text(TENACITY_STUB)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(stub)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # prepare.py calls `python`
    out = tmp_path / "ruler"
    command = [sys.executable, str(ruler_path("data", "prepare.py")), "--save_dir", str(out), "--task", "vt"]
    command += ["--tokenizer_path", str(tokenizer_dir), "--tokenizer_type", "hf"]
    command += ["--max_seq_length", "1024", "--num_samples", "2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    path = out / "vt" / "validation.jsonl"
    assert path.is_file(), done.stdout + done.stderr

    samples = load_ruler_jsonl(path, tokenizer=tokenizer)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s.index for s in samples] == [0, 1]
    for s, row in zip(samples, rows, strict=True):
        assert s.task == "vt" and s.template == "base"
        assert s.input == row["input"] and s.outputs == row["outputs"]
        assert s.metadata["ruler_length"] == row["length"]
        assert s.length == count_tokens(tokenizer, s.input) <= 1024
        for name in s.outputs:  # the chain is in the prompt
            assert f"VAR {name} =" in s.input
    assert score("vt", [" ".join(s.outputs) for s in samples], [s.outputs for s in samples]) == 100.0

    # the same prompt structure as qada's vt: identical lines once names and numbers are masked
    ours = TASKS.build("vt").generate(tokenizer, 1024 - 30, 1, seed=0)[0]

    def lines(text: str) -> set[str]:
        return set(re.sub(r"\d+", "N", re.sub(r"VAR [A-Z]+", "VAR X", re.sub(r"[A-Z]{3,5}", "X", text))).split("\n"))

    assert lines(ours.input) == lines(samples[0].input)
    assert ours.input.startswith(" Memorize and track") and samples[0].input.startswith(" Memorize and track")


def test_reads_rulers_niah_line_and_newer_fields(tmp_path):
    path = tmp_path / "niah_single_1" / "validation.jsonl"
    path.parent.mkdir()
    newer = {"index": 7, "input": "Question: 2 + 2?", "outputs": ["4"], "answer_prefix": " Answer:", "others": {}}
    path.write_text(json.dumps(NIAH_LINE) + "\n\n" + json.dumps(newer) + "\n")
    a, b = load_ruler_jsonl(path)
    assert a.task == "niah_single_1" and a.input == NIAH_LINE["input"] and a.outputs == ["4612365"]
    assert a.length is None and a.metadata == {"ruler_length": 963}
    assert b.index == 7 and b.input == "Question: 2 + 2? Answer:" and b.answer_prefix == " Answer:"
    assert b.metadata == {"others": {}}
    assert load_ruler_jsonl(path, task="mine")[0].task == "mine"


def test_round_trip(tmp_path, tokenizer):
    samples = TASKS.build("niah_single_2").generate(tokenizer, 512, 2, seed=1)
    save_ruler_jsonl(samples, tmp_path / "x.jsonl")
    back = load_ruler_jsonl(tmp_path / "x.jsonl", tokenizer=tokenizer)
    assert [(s.task, s.index, s.input, s.outputs, s.length, s.answer_prefix) for s in back] == [
        (s.task, s.index, s.input, s.outputs, s.length, s.answer_prefix) for s in samples
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"input": "x", "outputs": ["a"]', "line 2: not valid JSON"),
        ('["x"]', "line 2: expected a JSON object"),
        ('{"outputs": ["a"]}', "line 2: expected a string field 'input'"),
        ('{"input": "x", "outputs": "a"}', "line 2: expected 'outputs' to be a list of strings"),
    ],
)
def test_malformed_line_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(NIAH_LINE) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_ruler_jsonl(path)
