"""The evaluator on a tiny random Llama with the real SmolLM2 tokenizer: cache reuse, no leaks, resume, metrics."""

import json

import pytest
import torch

from qada.eval.configs import EvalConfig, paper_alphas, paper_taus, sweep_configs
from qada.eval.decode import decode_greedy, prefill
from qada.eval.evaluator import Evaluator
from qada.eval.tasks import TASKS
from qada.models import apply
from tests.tiny_models import tiny_model

WINDOW = {"t_local": 96, "t_sink": 4}  # random models attend almost uniformly: mixed decisions at tau 0.25


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory

    return AutoTokenizer.from_pretrained(model_directory(None))


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def samples(tokenizer):
    return TASKS.build("niah_single_2").generate(tokenizer, 400, 3, seed=0)


def configs():
    return [
        EvalConfig("dense", "dense", None, "sdpa", WINDOW, "dense"),
        EvalConfig("qada", {"name": "qada", "tau": 0.25}, "current", "sdpa", WINDOW, "qada/current"),
        EvalConfig("oracle", {"name": "oracle", "tau": 0.25}, None, "sdpa", WINDOW, "oracle"),
        EvalConfig("qada again", {"name": "qada", "tau": 0.25}, "current", "sdpa", WINDOW, "qada/current"),
    ]


@pytest.mark.parametrize("index", [1, 2])
def test_decoding_a_copied_cache_equals_generate_after_a_fresh_prefill(model, tokenizer, samples, index):
    ids = tokenizer(samples[0].input, return_tensors="pt", add_special_tokens=False)["input_ids"]
    prefilled = prefill(model, ids)
    length_before = prefilled.cache.get_seq_length()
    config = configs()[index]
    tokens = decode_greedy(model, prefilled, 12, run=config.build())
    assert prefilled.cache.get_seq_length() == length_before, "the shared prefilled cache must not change"
    with apply(model, criterion=config.criterion, moments=config.moments, window=WINDOW) as run:
        fresh = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                               do_sample=False, pad_token_id=0)
    assert tokens == fresh[0, ids.shape[1]:].tolist()
    assert 0 < run.summary()["sparsity"] < 1


def test_no_state_leaks_between_configurations_and_resume_skips_finished_work(model, tokenizer, samples, tmp_path):
    evaluator = Evaluator(model, tokenizer, configs(), tmp_path, record_oracle=True, progress=False)
    results = evaluator.evaluate(samples)
    rows = [json.loads(line) for line in (tmp_path / "results-rank0.jsonl").read_text().splitlines()]
    assert len(rows) == len(samples) * 4
    by = {(r["sample"], r["config"]): r for r in rows}
    for sample in {r["sample"] for r in rows}:
        first, again = by[(sample, "qada")], by[(sample, "qada again")]
        assert first["prediction"] == again["prediction"] and first["sparsity"] == again["sparsity"]
    # metrics equal a hand computation from the per-sample rows
    for label in ("dense", "qada", "oracle"):
        mine = [r for r in rows if r["config"] == label]
        assert results[label]["score"] == pytest.approx(sum(r["score"] for r in mine) / len(mine))
        assert results[label]["sparsity"] == pytest.approx(sum(r["sparsity"] for r in mine) / len(mine), abs=1e-6)
    assert results["dense"]["sparsity"] == 0.0 and results["dense"]["kv_read"] == 1.0
    qada_rows = [r for r in rows if r["config"] == "qada"]
    assert results["qada"]["kv_read"] == pytest.approx(sum(r["kv_read"] for r in qada_rows) / len(qada_rows))
    assert 0.0 < results["qada"]["kv_read"] < 1.0
    assert results["oracle"]["oracle_agreement"] == 1.0, "the oracle agrees with itself"
    assert 0.0 <= results["qada"]["oracle_agreement"] <= 1.0

    # an interrupted sweep is reported from its per-sample rows with the same means
    from qada.eval.report import records_from_rows

    rebuilt = {r["label"]: r for r in records_from_rows(tmp_path)}
    for label in ("dense", "qada", "oracle"):
        assert rebuilt[label]["n"] == len(samples)
        assert rebuilt[label]["score"] == pytest.approx(results[label]["score"])
        assert rebuilt[label]["sparsity"] == pytest.approx(results[label]["sparsity"], abs=1e-6)
        assert rebuilt[label]["kv_read"] == pytest.approx(results[label]["kv_read"], abs=1e-6)

    calls = []
    import qada.eval.evaluator as module

    original = module.decode_greedy
    module.decode_greedy = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        resumed = Evaluator(model, tokenizer, configs(), tmp_path, record_oracle=True, progress=False).evaluate(samples)
    finally:
        module.decode_greedy = original
    assert calls == [], "finished (sample, configuration) pairs must not be recomputed"
    for label in ("dense", "qada", "oracle"):
        assert resumed[label]["score"] == results[label]["score"]
        assert resumed[label]["sparsity"] == pytest.approx(results[label]["sparsity"])

    # a run killed in the middle of writing a line: that pair is recomputed, the rest is kept
    path = tmp_path / "results-rank0.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    assert len(Evaluator(model, tokenizer, configs(), tmp_path, progress=False).finished()) == len(lines) - 1
    module.decode_greedy = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with pytest.warns(UserWarning, match="torn last line"):
            again = Evaluator(model, tokenizer, configs(), tmp_path, record_oracle=True,
                              progress=False).evaluate(samples)
    finally:
        module.decode_greedy = original
    assert calls == [1], "only the torn pair runs again"
    repaired = path.read_text().splitlines()
    assert len(repaired) == len(lines) and all(json.loads(line) for line in repaired)
    assert again["qada again"]["score"] == results["qada again"]["score"]


def test_paper_grids_and_sweep_configs():
    taus = paper_taus()
    assert taus[0] == 0.1 and taus[-1] == 0.995 and taus == sorted(taus)
    alphas = paper_alphas()
    assert alphas[0] == 0.05 and alphas[-1] == 0.95 and len(alphas) == 19
    frequency = torch.rand(2, 4)
    sweep = sweep_configs([0.5], ("current",), static_masks={"static_oracle": frequency}, alphas=[0.25, 0.5])
    assert [c.label for c in sweep] == ["dense", "oracle tau=0.5", "qada/current tau=0.5",
                                        "static_oracle alpha=0.25", "static_oracle alpha=0.5"]
    assert sum(map(sum, sweep[-1].criterion["mask"])) == 4


def test_duplicate_labels_are_refused(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unique configuration labels"):
        Evaluator(model, tokenizer, [configs()[0], configs()[0]], tmp_path)


def test_worst_case_drop_takes_the_worst_task():
    from qada.eval.report import worst_case_drop

    def record(task, label, family, score, sparsity):
        return {"task": task, "length": 2048, "label": label, "family": family, "score": score, "sparsity": sparsity}

    records = [
        record("a", "dense", "dense", 100, 0.0), record("b", "dense", "dense", 80, 0.0),
        record("a", "qada tau=0.6", "qada", 90, 0.8), record("b", "qada tau=0.6", "qada", 40, 0.6),
    ]
    [row] = worst_case_drop(records)
    assert row["worst_drop"] == 40 and row["worst_task"] == "b@2048" and row["mean_sparsity"] == pytest.approx(0.7)


def test_moment_source_specs_for_ablations():
    from qada.cli.sweep import split_moment_sources
    from qada.eval.configs import moment_label, parse_moment_source

    assert split_moment_sources("stored,current") == ("stored", "current")
    assert split_moment_sources("current;stored:prompt=text,offset=2048") == (
        "current", "stored:prompt=text,offset=2048")
    config = parse_moment_source("stored:prompt=single_word,offset=2048,include_sinks=true")
    assert config == {"name": "stored", "prompt": "single_word", "offset": 2048, "include_sinks": True}
    assert parse_moment_source(moment_label(config)) == config
    [cfg] = sweep_configs([0.6], ("stored:prompt=text",), include_oracle=False, include_dense=False)
    assert cfg.moments == {"name": "stored", "prompt": "text"} and cfg.label == "qada/stored:prompt=text tau=0.6"
    cfg.build()  # the registry accepts it
    with pytest.raises(ValueError, match="key=value"):
        parse_moment_source("stored:text")


def test_a_criterion_reading_prompt_queries_says_so_in_its_identity(model, tokenizer, tmp_path):
    """Rows of a tail-aware criterion decoded without the prompt's queries (an empty heavy set) never resume."""
    tail = EvalConfig("tail", {"name": "qada_tail", "tau": 0.25}, "current", "sdpa", WINDOW, "qada_tail")
    pages_only = EvalConfig("pages", {"name": "qada_tail", "heavy": 0}, "current", "sdpa", WINDOW, "qada_tail")
    evaluator = Evaluator(model, tokenizer, [*configs(), tail, pages_only], tmp_path, progress=False)
    assert evaluator.config_identity(tail)["prompt_queries"] == 32
    assert "prompt_queries" not in evaluator.config_identity(pages_only)
    assert "prompt_queries" not in evaluator.config_identity(configs()[1])
