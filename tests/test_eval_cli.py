"""``qada eval`` and ``qada demo`` from the command line."""

import json

import pytest

from qada.cli import main
from qada.eval.tasks import TASKS, save_ruler_jsonl


def test_eval_writes_the_result_json_for_a_task_and_for_a_ruler_jsonl(tiny_model_dir, tmp_path, capsys):
    path, tokenizer = tiny_model_dir
    out = tmp_path / "r.json"
    assert main(["eval", "--task", "niah_single_2", "--length", "300", "--samples", "2", "--criterion", "qada",
                 "--tau", "0.3", "--moments", "current", "--model", str(path), "--record-oracle",
                 "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    for key in ("task", "length", "n", "criterion", "moments", "executor", "score", "sparsity", "kv_sparsity",
                "oracle_agreement", "model", "qada_version", "seed", "decode_seconds"):
        assert key in record, key
    assert record["n"] == 2 and record["criterion"] == {"name": "qada", "tau": 0.3}
    assert record["model"]["num_layers"] == 2

    data = tmp_path / "ruler.jsonl"
    save_ruler_jsonl(TASKS.build("vt").generate(tokenizer, 800, 2, seed=1), data)
    out2 = tmp_path / "r2.json"
    assert main(["eval", "--data", str(data), "--criterion", "dense", "--model", str(path), "--out", str(out2)]) == 0
    assert json.loads(out2.read_text())["n"] == 2
    assert "dense" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_quick_runs_on_the_embedded_model(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for label in ("dense", "oracle tau=0.6", "qada/current tau=0.6", "static_oracle alpha=0.5",
                  "qada_tail/current tau=0.3", "kv_read", "dec tok/s"):
        assert label in out
    records = json.loads((tmp_path / "results.json").read_text())
    assert {r["task"] for r in records} == {"niah_single_1", "niah_single_2"}
    tail = [r for r in records if r["label"].startswith("qada_tail")]
    assert len(tail) == 2 and all(r["kv_read"] is not None and 0 < r["kv_read"] <= 1 for r in tail)
    assert (tmp_path / "score_vs_sparsity.png").stat().st_size > 0


def test_generate_prints_text_and_a_sparsity_summary(tiny_model_dir, tmp_path, capsys):
    path, _ = tiny_model_dir
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The pass key is 12345. " * 40 + "What is the pass key? The pass key is")
    assert main(["generate", "--prompt-file", str(prompt), "--model", str(path), "--criterion", "qada", "--tau",
                 "0.3", "--moments", "current", "--t-local", "64", "--t-sink", "4", "--max-new-tokens", "4",
                 "--per-layer"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "sparsity:" in out and "kv_sparsity:" in out and "fail-safe fallbacks: 0" in out
    assert "layer  sparsity  kv_sparsity" in out
    assert "executor: auto chose sdpa: the model is on cpu" in out  # the default, and why
    assert main(["generate", "--prompt-file", str(prompt), "--model", str(path), "--criterion", "qada", "--moments",
                 "current", "--executor", "reference", "--max-new-tokens", "2"]) == 0
    assert "executor: reference\n" in capsys.readouterr().out
    assert main(["generate", "--prompt-file", str(prompt), "--model", str(path), "--criterion", "dense",
                 "--max-new-tokens", "2"]) == 0
    assert "unmodified model" in capsys.readouterr().out
