"""The paper's analyses computed from one recorded run (tiny model), checked against the live decisions."""

import json
import math

import numpy as np
import pytest
import torch

from qada.eval.analysis import (
    DecisionLog,
    head_local_frequency,
    head_types,
    log_error_table,
    per_step_sparsity,
    sparsity_vs_tau,
)
from qada.models import DecisionRecorder, apply
from tests.tiny_models import saved_tiny_model, tiny_model

WINDOW = {"t_local": 32, "t_sink": 4}


@pytest.fixture(scope="module")
def recorded():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 150), generator=torch.Generator().manual_seed(0))
    log, recorder = DecisionLog(), DecisionRecorder(wants_oracle=True)
    with apply(model, criterion={"name": "oracle", "tau": 0.1}, moments="current", window=WINDOW,
               observers=[log, recorder]):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
    return log.arrays(), recorder.events


def test_offline_sparsity_at_any_tau_equals_the_live_decisions(recorded):
    arrays, events = recorded
    curves = sparsity_vs_tau(arrays, [0.1])
    live = torch.cat([e.local.flatten() for e in events]).float().mean().item()
    assert curves["oracle"][0] == pytest.approx(live)
    curves = sparsity_vs_tau(arrays, [0.0, 0.05, 0.1, 0.3, 1.0])
    assert curves["oracle"][0] == 1.0 and curves["oracle"] == sorted(curves["oracle"], reverse=True)
    assert curves["qada"] == sorted(curves["qada"], reverse=True)


def test_head_maps_steps_and_types(recorded):
    arrays, _ = recorded
    maps = head_local_frequency(arrays, 0.1, 2, 4)
    assert maps["oracle"].shape == (2, 4) and np.all((maps["oracle"] >= 0) & (maps["oracle"] <= 1))
    steps = per_step_sparsity(arrays, 0.1)
    assert steps["step"] == list(range(5))
    types = head_types(maps["oracle"])
    assert sum(types.values()) == pytest.approx(1.0)


def test_log_error_table_rows_and_exactness_of_the_control():
    n = 400
    rng = np.random.default_rng(0)
    arrays = {
        "log_local": rng.normal(size=n), "log_bulk": rng.normal(size=n) + 5,
        "score_mean": np.zeros(n), "score_var": np.zeros(n), "t_bulk": np.full(n, 1000.0),
    }
    arrays["estimate"] = np.full(n, math.log(1000.0))
    rows = log_error_table(arrays)
    assert [r["selection"] for r in rows] == ["all heads", "top 20% local", "top 10% local", "i.i.d. Gaussian control"]
    assert rows[1]["n"] == 80 and rows[2]["n"] == 40
    # sigma_s = 0: the Gaussian bulk is T_bulk equal scores, whose mass the estimate gives exactly
    assert rows[3]["abs_log_error_lognormal"] == pytest.approx(0.0, abs=1e-9)


def test_analyze_cli_writes_every_output(tmp_path):
    from qada.cli import main

    model_dir = saved_tiny_model(tmp_path / "tiny")
    out = tmp_path / "analysis"
    assert main(["analyze", "--task", "niah_single_2", "--length", "300", "--samples", "2", "--tokens", "4",
                 "--tau", "0.2", "--model", str(model_dir), "--out", str(out)]) == 0
    table = json.loads((out / "table2_log_error.json").read_text())
    assert table["rows"][-1]["selection"] == "i.i.d. Gaussian control"
    maps = json.loads((out / "head_maps.json").read_text())
    assert np.array(maps["long_context_frequency"]["qada"]).shape == (2, 4)
    for name in ("head_maps.png", "sparsity_vs_tau.png", "per_token_sparsity.png"):
        assert (out / name).stat().st_size > 0
