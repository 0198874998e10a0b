"""qada as an lm-evaluation-harness model (issue 24): model_args, the real CLI path offline, statistics, bad input.

The task folder is made by :func:`qada.integrations.lm_eval_task.write_task` from qada's niah generator (a YAML and
its local jsonl); every run goes through lm-eval's own command line (``python -m qada.integrations.lm_eval``'s
:func:`main`, in process) on the embedded SmolLM2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed")

from qada.integrations.lm_eval import main, qada_table  # noqa: E402
from qada.integrations.lm_eval_args import QAdaArgumentError, parse_qada_args  # noqa: E402

LENGTH, SAMPLES = 384, 3


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    from transformers import AutoTokenizer

    from qada.integrations.lm_eval_task import write_task
    from qada.models.loading import model_directory

    out = tmp_path_factory.mktemp("lm_eval_tasks")
    tokenizer = AutoTokenizer.from_pretrained(model_directory(None))
    write_task(out, "niah_single_1", LENGTH, SAMPLES, 0, tokenizer, name="qada_test_niah")
    data = out / "qada_test_niah.jsonl"
    (out / "qada_test_ll.yaml").write_text(f"""task: qada_test_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{input}}}}"
doc_to_target: "{{{{' ' + answer}}}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
""")
    return out


def evaluate(tasks: Path, out: Path, model: str, model_args: str, task: str = "qada_test_niah") -> dict:
    """Run lm-eval's CLI; returns the results file's content plus the samples per doc id and the exit code."""
    code = main(["run", "--model", model, "--model_args", model_args, "--tasks", task, "--include_path", str(tasks),
                 "--output_path", str(out), "--log_samples", "--device", "cpu"])
    assert code == 0
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    results["by_doc"] = {s["doc_id"]: s for s in samples}
    return results


# --- model_args -----------------------------------------------------------------------------------------------


def test_model_args_are_parsed_and_the_rest_goes_to_lm_eval():
    parsed, rest = parse_qada_args({"pretrained": "smollm2-135m", "criterion": "{name: qada_tail, tau: 0.3}",
                                    "window": 64, "batch_size": 2, "max_length": 1024})
    assert parsed.criterion == {"name": "qada_tail", "tau": 0.3} and parsed.window == {"t_local": 64}
    assert rest == {"batch_size": 2, "max_length": 1024}
    parsed, _ = parse_qada_args({"criterion": {"name": "qada", "tau": 0.2}, "window": "{t_local: 32, t_sink: 4}",
                                 "tau": "0.5"})
    assert parsed.criterion == {"name": "qada", "tau": 0.2} and parsed.window == {"t_local": 32, "t_sink": 4}
    assert parsed.tau == 0.5 and parsed.pretrained == "smollm2-135m" and parsed.device == "cpu"


@pytest.mark.parametrize("args, match", [
    ({"criterion": "{name: qada, tau: [}"}, "model_args criterion: could not parse"),
    ({"criterion": "{tau: 0.3}"}, "with a 'name' key"),
    ({"static": "/nonexistent/mask.safetensors"}, "model_args static: head-mask file"),
    ({"static": __file__, "criterion": "qada"}, "either criterion or static"),
    ({"imports": "qada_no_such_plugin_module"}, "model_args imports: could not import"),
    ({"config": "/nonexistent/run.yaml"}, "model_args config"),
    ({"window": "{t_local: -3}"}, "model_args window"),
    ({"tau": "high"}, "model_args tau"),
])
def test_bad_model_args_are_one_clear_error(args, match):
    with pytest.raises(QAdaArgumentError, match=match):
        parse_qada_args(args)


def test_a_key_neither_qada_nor_lm_evals_model_takes_is_an_error_not_dropped():
    from qada.integrations.lm_eval import hf_parameters

    others = hf_parameters()
    assert {"batch_size", "max_length", "device"} <= set(others) and "kwargs" not in others
    with pytest.raises(QAdaArgumentError, match=r"model_args tua: unknown argument .*did you mean 'tau'\?"):
        parse_qada_args({"criterion": "qada", "tua": 0.1}, others=others)
    _, rest = parse_qada_args({"criterion": "qada", "tau": 0.1, "max_length": 512}, others=others)
    assert rest == {"max_length": 512}


# --- the real CLI path on the embedded model --------------------------------------------------------------------


@pytest.mark.slow
def test_dense_equals_lm_evals_own_hf_model_sample_by_sample(tasks, tmp_path):
    from qada.models.loading import model_directory

    qada = evaluate(tasks, tmp_path / "qada", "qada", "pretrained=smollm2-135m,criterion=dense")
    hf = evaluate(tasks, tmp_path / "hf", "hf", f"pretrained={model_directory(None)},dtype=float32")
    assert sorted(qada["by_doc"]) == sorted(hf["by_doc"]) == list(range(SAMPLES))
    for doc, sample in qada["by_doc"].items():
        assert sample["resps"] == hf["by_doc"][doc]["resps"], doc
    assert qada["results"]["qada_test_niah"]["exact_match,first_number"] > 0
    stats = qada["config"]["qada"]["tasks"]["qada_test_niah"]
    assert stats["qada_active"] and stats["sparsity"] == 0.0 and stats["kv_read"] == 1.0
    assert stats["requests"]["generate_until"] == SAMPLES and stats["decode_tokens_per_s"] > 0


@pytest.mark.slow
def test_qada_decodes_sparsely_and_reports_it(tasks, tmp_path, capsys):
    args = json.dumps({"pretrained": "smollm2-135m", "criterion": {"name": "qada", "tau": 0.3},
                       "window": {"t_local": 64, "t_sink": 8}})
    results = evaluate(tasks, tmp_path, "qada", args)
    summary = results["config"]["qada"]
    stats = summary["tasks"]["qada_test_niah"]
    assert 0 < stats["sparsity"] <= 1 and 0 < stats["kv_sparsity"] <= 1 and stats["fail_safe"] == 0
    assert stats["kv_sparsity_all_layers"] == pytest.approx(stats["kv_sparsity"])  # no sliding layers on SmolLM2
    assert summary["configuration"]["criterion"] == {"name": "qada", "tau": 0.3}
    assert summary["configuration"]["window"] == {"t_local": 64, "t_sink": 8}
    assert len(summary["digest"]) == 16
    printed = capsys.readouterr().out
    assert "| qada_test_niah | generate_until 3 | yes |" in printed and summary["digest"][:12] in printed


@pytest.mark.slow
def test_log_likelihood_tasks_say_qada_changed_nothing(tasks, tmp_path):
    results = evaluate(tasks, tmp_path, "qada", "pretrained=smollm2-135m,criterion=qada", task="qada_test_ll")
    stats = results["config"]["qada"]["tasks"]["qada_test_ll"]
    assert stats["qada_active"] is False and stats["requests"]["loglikelihood"] == SAMPLES
    assert "changed nothing" in stats["note"] and stats["sparsity"] is None
    assert "changed nothing" in qada_table(results["config"]["qada"])


@pytest.mark.slow
@pytest.mark.parametrize("model_args, match", [
    ("pretrained=smollm2-135m,criterion=no_such_criterion", "no_such_criterion"),
    ("pretrained=smollm2-135m,criterion={name: qada}", "Invalid JSON"),
    ("pretrained=smollm2-135m,static=/nonexistent.safetensors", "head-mask file"),
    ("pretrained=smollm2-135m,imports=qada_no_such_plugin_module", "could not import"),
    ("pretrained=/nonexistent/model-dir", "pretrained="),
    ("pretrained=smollm2-135m,criterion=qada,tua=0.1", "did you mean 'tau'"),
])
def test_bad_model_args_on_the_command_line_are_one_line(tasks, tmp_path, capsys, model_args, match):
    code = main(["run", "--model", "qada", "--model_args", model_args, "--tasks", "qada_test_niah",
                 "--include_path", str(tasks), "--output_path", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    line = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(line) == 1 and match in line[0], err[-2000:]
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_second_run_in_the_process_logs_to_the_stderr_of_its_own_time(tasks, tmp_path, capsys, monkeypatch):
    """lm-eval binds its console handler to the first run's stderr; a later run must not write to that stream once
    it is closed (a notebook cell's, or an earlier test's captured output)."""
    import io

    args = ["run", "--model", "qada", "--model_args", "pretrained=smollm2-135m,criterion=no_such_criterion",
            "--tasks", "qada_test_niah", "--include_path", str(tasks), "--output_path", str(tmp_path),
            "--device", "cpu"]
    first = io.StringIO()
    with monkeypatch.context() as patch:
        patch.setattr("sys.stderr", first)
        assert main(args) == 2
    first.close()
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err[-2000:]
    assert "Initializing qada model" in err  # lm-eval's own log line reached the second run's stderr
