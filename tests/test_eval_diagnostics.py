"""Decision diagnostics (issue 23): each criterion's decisions against the oracle's on one trajectory."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tiny_models import saved_tiny_model, tiny_model

from qada.criteria import CRITERIA
from qada.eval.diagnostics import CriterionProbe, decision_diagnostics, diagnostics_markdown
from qada.models import attach, build_run


def test_the_rates_count_what_they_say():
    """Four heads: the oracle at tau 0.5 calls heads 0 and 1 dense (local ratio < 0.5), 2 and 3 local."""
    log_local = np.zeros(4)
    log_bulk = np.array([1.0, 2.0, -1.0, -2.0])
    arrays = {"log_local": log_local, "log_bulk": log_bulk,
              "a/local": np.array([0, 1, 1, 0], dtype=bool),  # dense on 0 and 3: recall 1/2, false dense 1/2
              "a/log_bulk": log_bulk - np.array([0.5, 1.5, 0.0, 0.0]),
              "a/log_exact": log_bulk + np.log([0.25, 0.75, 1.0, 1.0]),
              "b/local": np.array([0, 0, 1, 1], dtype=bool)}  # the oracle's own decisions
    a, b = decision_diagnostics(arrays, 0.5)
    assert a["criterion"] == "a" and a["heads"] == 4 and a["oracle_dense"] == 2
    assert a["recall"] == 0.5 and a["false_dense"] == 0.5 and a["sparsity"] == 0.5
    assert a["log_error_dense"] == pytest.approx(-1.0)  # median of -0.5 and -1.5
    assert a["exact_share_dense"] == pytest.approx(0.5)  # median of 0.25 and 0.75
    assert b["recall"] == 1.0 and b["false_dense"] == 0.0 and b["log_error_dense"] is None
    assert "| a | 4 | 2 | 0.500 | - | 0.500 | 0.500 | -1.000 | 0.500 |" in diagnostics_markdown([a, b], 0.5, "cmd")
    with pytest.raises(ValueError, match="tau in"):
        decision_diagnostics(arrays, 0.0)


def test_nothing_to_measure_is_none():
    arrays = {"log_local": np.zeros(2), "log_bulk": np.full(2, -5.0), "a/local": np.ones(2, dtype=bool)}
    (row,) = decision_diagnostics(arrays, 0.6)  # every head local for the oracle: no dense head to recall
    assert row["recall"] is None and row["false_dense"] == 0.0


def test_a_probe_on_a_model_sees_every_step_and_the_oracle_recalls_itself():
    torch.manual_seed(0)
    model = tiny_model("llama")
    probes = {"oracle": CRITERIA.build({"name": "oracle", "tau": 0.19}),
              "qada": CRITERIA.build({"name": "qada", "tau": 0.19}),
              "qada_tail": CRITERIA.build({"name": "qada_tail", "tau": 0.19, "heavy": 4, "observe": 4,
                                           "page_size": 4, "pages": 2}),
              "local": CRITERIA.build("local")}
    probe = CriterionProbe(CRITERIA.build("dense"), probes)
    run = build_run(probe, "current", "sdpa", {"t_local": 8, "t_sink": 2})
    attach(model, run)
    try:
        ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    finally:
        run.remove()
    arrays = probe.arrays()
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert arrays["log_local"].size == layers * 2 * heads * (out.shape[1] - ids.shape[1] - 1)  # every decode step
    assert run.summary()["sparsity"] == 0.0  # the primary (dense) decided: the probes changed nothing
    rows = {row["criterion"]: row for row in decision_diagnostics(arrays, 0.19)}
    assert rows["oracle"]["recall"] == 1.0 and rows["oracle"]["false_dense"] == 0.0
    assert 0 < rows["oracle"]["oracle_dense"] < rows["oracle"]["heads"]
    assert rows["qada"]["log_error_dense"] is not None and rows["qada"]["exact_share_dense"] is None
    assert 0.0 < rows["qada_tail"]["exact_share_dense"] <= 1.0
    assert rows["qada_tail"]["recall"] >= rows["qada"]["recall"]  # E only adds mass to the estimate
    # kv_read as the run counts it: all local reads the window of 8 of T = 41..44 tokens at the 4 decode steps
    lengths = range(ids.shape[1] + 1, out.shape[1])
    assert rows["local"]["kv_read"] == pytest.approx(sum(8 / T for T in lengths) / len(lengths))
    assert rows["local"]["kv_read"] < rows["oracle"]["kv_read"] <= 1.0
    assert rows["qada_tail"]["kv_read"] > rows["local"]["kv_read"]  # (its reads to decide count)


def test_a_probe_needs_criteria():
    with pytest.raises(ValueError, match="at least one"):
        CriterionProbe(CRITERIA.build("dense"), {})
    with pytest.raises(ValueError, match="HeadCriterion"):
        CriterionProbe(CRITERIA.build("dense"), {"x": "qada"})


def test_probed_criteria_from_the_command_line():
    from qada.cli.analyze import probed_criteria

    probes = probed_criteria(["qada", '{"name": "qada_budget", "sparsity": 0.8}', "local"], 0.3)
    assert list(probes) == ["qada tau=0.3", "qada_budget sparsity=0.8", "local"]
    assert math.isclose(probes["qada tau=0.3"].tau, 0.3)
    with pytest.raises(ValueError, match="twice"):
        probed_criteria(["qada", "qada"], 0.3)
    with pytest.raises(ValueError, match="unknown criterion"):
        probed_criteria(["nope"], 0.3)


def test_analyze_writes_the_diagnostics(tmp_path, capsys):
    from qada.cli import main

    model_dir = saved_tiny_model(tmp_path / "tiny")
    out = tmp_path / "analysis"
    assert main(["analyze", "--task", "niah_single_2", "--length", "300", "--samples", "1", "--tokens", "3",
                 "--tau", "0.2", "--model", str(model_dir), "--out", str(out), "--criteria", "oracle",
                 "--criteria", "qada_tail"]) == 0
    rows = json.loads((out / "decision_diagnostics.json").read_text())["rows"]
    assert [r["criterion"] for r in rows] == ["oracle tau=0.2", "qada_tail tau=0.2"]
    assert rows[0]["recall"] in (1.0, None) and rows[0]["false_dense"] in (0.0, None)
    assert "qada_tail tau=0.2" in (out / "decision_diagnostics.md").read_text()
    assert "recall" in capsys.readouterr().out
    assert main(["analyze", "--out", str(tmp_path / "bad"), "--criteria", "nope"]) == 2
