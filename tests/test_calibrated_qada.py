"""Calibrated QAdA (issue 16): the per-head correction of the lognormal estimate, its fit, artifact and CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qada.artifacts import (
    ArtifactError,
    load_qada_correction,
    save_artifact,
    save_qada_correction,
)
from qada.criteria import CRITERIA, CalibratedQAdACriterion, QAdACriterion
from qada.functional import apply_log_correction, fit_log_correction
from qada.moments import BulkMoments
from qada.step import DecodeStep
from qada.window import Window
from tests.helpers import population_moments

FP = {"model_type": "llama", "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
      "hidden_size": 64, "max_positions": 2048, "rope": {"rope_theta": 10000.0, "rope_scaling": None}}


# --- the fit ---------------------------------------------------------------------------------------------------


def _synthetic(slope, offset, n=400, noise=0.0, seed=0):
    """``(estimate, truth, log_t [n, 1, 1])`` with ``truth - log_t = slope (estimate - log_t) + offset + noise``."""
    g = torch.Generator().manual_seed(seed)
    L, H = slope.shape
    log_t = torch.empty(n, 1, 1, dtype=torch.float64).uniform_(math.log(100), math.log(5000), generator=g)
    x = torch.randn(n, L, H, generator=g, dtype=torch.float64) * 2 + 1
    y = slope * x + offset + noise * torch.randn(n, L, H, generator=g, dtype=torch.float64)
    return x + log_t, y + log_t, log_t


def test_fit_recovers_a_known_slope_and_offset():
    slope = torch.tensor([[0.5, 1.0, 1.5], [0.8, 2.0, 1.2]], dtype=torch.float64)
    offset = torch.tensor([[1.0, -2.0, 0.0], [0.3, 0.5, -0.7]], dtype=torch.float64)
    estimate, truth, log_t = _synthetic(slope, offset, noise=0.05)
    fit = fit_log_correction(estimate, truth, log_t, ridge=1e-6)
    torch.testing.assert_close(fit.slope.double(), slope, atol=0.01, rtol=0)
    torch.testing.assert_close(fit.offset.double(), offset, atol=0.02, rtol=0)
    assert fit.count.tolist() == [[400] * 3] * 2
    # the corrected estimate is (nearly) the truth
    corrected = apply_log_correction(estimate, estimate - log_t, fit.slope.double(), fit.offset.double())
    assert (corrected - truth).abs().mean() < 0.05 < (estimate - truth).abs().mean()


def test_a_perfect_estimator_gets_exactly_the_identity():
    estimate, _, log_t = _synthetic(torch.ones(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64))
    for ridge in (0.0, 1.0, 50.0):
        fit = fit_log_correction(estimate, estimate.clone(), log_t, ridge)
        assert torch.equal(fit.slope, torch.ones(3, 4)) and torch.equal(fit.offset, torch.zeros(3, 4))


def test_ridge_keeps_degenerate_heads_at_the_identity():
    n = 50
    estimate = torch.randn(n, 1, 4, dtype=torch.float64) + 5.0
    truth = estimate * 1.7 - 1.0
    log_t = torch.zeros(n, 1, 1, dtype=torch.float64)
    estimate[:, 0, 0] = float("nan")  # head 0: no usable sample
    estimate[:, 0, 1], truth[:, 0, 1] = 2.0, 2.0  # head 1: x does not vary and the estimate is right
    estimate[:, 0, 2], truth[:, 0, 2] = 2.0, 2.5  # head 2: x does not vary, a constant error of 0.5
    estimate[1:, 0, 3] = float("inf")  # head 3: a single sample
    fit = fit_log_correction(estimate, truth, log_t, ridge=1.0)
    assert fit.count[0].tolist() == [0, n, n, 1]
    assert fit.slope[0, :3].tolist() == [1.0, 1.0, 1.0]
    assert fit.offset[0, :2].tolist() == [0.0, 0.0]
    assert fit.offset[0, 2].item() == pytest.approx(0.5 * n / (n + 1))  # only the mean error, shrunk by the ridge
    strong = fit_log_correction(estimate, truth, log_t, ridge=1e6)  # a strong ridge: every head near identity
    torch.testing.assert_close(strong.slope, torch.ones(1, 4), atol=1e-3, rtol=0)
    torch.testing.assert_close(strong.offset, torch.zeros(1, 4), atol=1e-3, rtol=0)


def test_nan_and_inf_samples_are_ignored():
    slope = torch.full((2, 3), 0.7, dtype=torch.float64)
    estimate, truth, log_t = _synthetic(slope, torch.full((2, 3), 0.4, dtype=torch.float64), noise=0.1, seed=3)
    clean = fit_log_correction(estimate, truth, log_t)
    bad_e, bad_t = estimate.clone(), truth.clone()
    extra_e = torch.full((5, 2, 3), float("nan"), dtype=torch.float64)
    extra_t = torch.randn(5, 2, 3, dtype=torch.float64)
    extra_e[0], extra_t[1] = 1.0, float("inf")
    extra_t[0] = float("-inf")  # a head without a bulk mass
    fit = fit_log_correction(torch.cat([bad_e, extra_e]), torch.cat([bad_t, extra_t]),
                             torch.cat([log_t, torch.zeros(5, 1, 1, dtype=torch.float64)]))
    torch.testing.assert_close(fit.slope, clean.slope)
    torch.testing.assert_close(fit.offset, clean.offset)
    assert torch.equal(fit.count, clean.count)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="one shape"):
        fit_log_correction(torch.zeros(3, 2, 2), torch.zeros(3, 2, 3), torch.zeros(1))
    with pytest.raises(ValueError, match="ridge"):
        fit_log_correction(torch.zeros(3, 2, 2), torch.zeros(3, 2, 2), torch.zeros(1), ridge=-1.0)


# --- the criterion ---------------------------------------------------------------------------------------------


def _step(seed, T, b=2, layer=0, pad=False, scale_keys=2.0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, 2, T, 16, generator=g) * scale_keys
    query = torch.randn(b, 4, 16, generator=g) * 2
    window = Window(32, 4)
    start = torch.randint(0, max(T // 3, 1), (b,), generator=g) if pad else None
    moments = population_moments(keys[:, :, 4: max(T - 28, 5)])
    return DecodeStep(query, keys, 0.25, window, layer=layer, start=start, moments=moments)


def _decisions(criterion, seed, T, layer, pad, scale_keys=2.0):
    step = _step(seed, T, layer=layer, pad=pad, scale_keys=scale_keys)
    local = criterion(step)
    return local, (0 if step.fail_safe is None else int(step.fail_safe))


grids = st.lists(st.floats(-3, 3, allow_nan=False), min_size=12, max_size=12).map(
    lambda v: torch.tensor(v).view(3, 4))
steps = dict(seed=st.integers(0, 10_000), T=st.integers(1, 200), layer=st.integers(0, 2), pad=st.booleans(),
             scale_keys=st.sampled_from([0.5, 2.0, 6.0]))


@given(tau=st.floats(0.0, 1.0), **steps)
def test_identity_correction_decides_exactly_as_qada(tau, seed, T, layer, pad, scale_keys):
    identity = CalibratedQAdACriterion(tau, slope=torch.ones(3, 4), offset=torch.zeros(3, 4))
    (got, got_fail_safe), (expected, expected_fail_safe) = (
        _decisions(c, seed, T, layer, pad, scale_keys) for c in (identity, QAdACriterion(tau)))
    assert torch.equal(got, expected) and got_fail_safe == expected_fail_safe


@given(taus=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)), slope=grids, offset=grids, **steps)
def test_local_sets_shrink_as_tau_grows(taus, slope, offset, seed, T, layer, pad, scale_keys):
    low, high = sorted(taus)
    local_low, _ = _decisions(CalibratedQAdACriterion(low, slope=slope.abs(), offset=offset), seed, T, layer, pad,
                              scale_keys)
    local_high, _ = _decisions(CalibratedQAdACriterion(high, slope=slope.abs(), offset=offset), seed, T, layer,
                               pad, scale_keys)
    assert not (local_high & ~local_low).any()


@given(tau=st.floats(0.0, 1.0), slope=grids, offset=grids, shift=grids, **steps)
def test_a_larger_offset_never_makes_more_heads_local(tau, slope, offset, shift, seed, T, layer, pad, scale_keys):
    smaller = CalibratedQAdACriterion(tau, slope=slope, offset=offset)
    larger = CalibratedQAdACriterion(tau, slope=slope, offset=offset + shift.abs())
    local_small, _ = _decisions(smaller, seed, T, layer, pad, scale_keys)
    local_large, _ = _decisions(larger, seed, T, layer, pad, scale_keys)
    assert not (local_large & ~local_small).any()


def test_the_corrected_estimate_is_the_formula():
    step = _step(0, 150, layer=1)
    slope, offset = torch.rand(3, 4) + 0.5, torch.randn(3, 4)
    criterion = CalibratedQAdACriterion(0.6, slope=slope, offset=offset)
    mu_s, var_s = step.score_moments
    expected = torch.log(step.t_bulk.double())[:, None] + slope[1] * (mu_s + var_s / 2) + offset[1]
    torch.testing.assert_close(criterion.log_bulk(step).double(), expected.double(), rtol=1e-5, atol=1e-5)


def test_non_finite_estimates_are_dense_and_counted():
    step = _step(0, 150)
    nan = BulkMoments(torch.full((2, 2, 16), float("nan")), torch.zeros(2, 2, 16, 16))
    bad = DecodeStep(step.query, step.keys, 0.25, step.window, moments=nan)
    assert not CalibratedQAdACriterion(0.0, slope=torch.ones(3, 4), offset=torch.zeros(3, 4))(bad).any()
    assert bad.fail_safe.item() == 8


def test_criterion_configuration_and_model_checks(tmp_path):
    criterion = CRITERIA.build({"name": "qada_calibrated", "tau": 0.5, "slope": [[1.0] * 4] * 3,
                                "offset": [[0.0] * 4] * 3})
    assert criterion.needs() == {"moments": True, "full_scores": False, "calibration": True}
    assert CRITERIA.build(criterion.to_config()).to_config() == criterion.to_config()
    criterion.check_model(3, 4)
    with pytest.raises(ValueError, match=r"shape \[2, 4\] for this model"):
        criterion.check_model(2, 4)
    with pytest.raises(ValueError, match="does not fit layer 3"):
        criterion(_step(0, 100, layer=3))
    with pytest.raises(ValueError, match="neither"):
        CalibratedQAdACriterion()
    with pytest.raises(ValueError, match="only slope"):
        CalibratedQAdACriterion(slope=[[1.0]])
    with pytest.raises(ValueError, match="finite slope"):
        CalibratedQAdACriterion(slope=[[float("nan")]], offset=[[0.0]])
    with pytest.raises(ValueError, match="one shape"):
        CalibratedQAdACriterion(slope=[[1.0, 1.0]], offset=[[0.0]])
    with pytest.raises(ValueError, match=r"shape \[layers, heads\]"):
        CalibratedQAdACriterion(slope=[1.0], offset=[0.0])
    with pytest.raises(ValueError, match="not both"):
        CalibratedQAdACriterion(correction="x.safetensors", slope=[[1.0]], offset=[[0.0]])
    with pytest.raises(ValueError, match="tau"):
        CalibratedQAdACriterion(1.5, slope=[[1.0]], offset=[[0.0]])


# --- the artifact ----------------------------------------------------------------------------------------------


def test_correction_artifact_round_trip_and_criterion_from_file(tmp_path):
    slope, offset = torch.rand(3, 4) + 0.5, torch.randn(3, 4)
    count = torch.randint(0, 100, (3, 4))
    path = save_qada_correction(tmp_path / "c.safetensors", slope, offset, FP, count=count,
                                info={"tasks": "niah_single_1", "n": 2})
    back_slope, back_offset, info = load_qada_correction(path, FP)
    assert torch.equal(back_slope, slope) and torch.equal(back_offset, offset)
    assert info.kind == "qada_correction" and info.info == {"tasks": "niah_single_1", "n": 2}
    assert info.tensors["count"][0] == (3, 4)
    from_file = CalibratedQAdACriterion(0.6, correction=str(path))
    inline = CalibratedQAdACriterion(0.6, slope=slope, offset=offset)
    for layer in range(3):
        assert torch.equal(from_file(_step(layer, 160, layer=layer)), inline(_step(layer, 160, layer=layer)))
    assert CRITERIA.build(from_file.to_config()).correction == str(path)


def test_bad_correction_artifacts_are_refused(tmp_path):
    good = (torch.ones(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"shape \[3, 4\] for this model"):
        save_qada_correction(tmp_path / "s.safetensors", torch.ones(2, 4), torch.zeros(2, 4), FP)
    with pytest.raises(ValueError, match="finite"):
        save_qada_correction(tmp_path / "s.safetensors", torch.full((3, 4), float("inf")), torch.zeros(3, 4), FP)
    # files written around the checks: wrong shape, non-finite, a missing tensor, another kind
    shape = save_artifact(tmp_path / "shape.safetensors", "qada_correction",
                          {"slope": torch.ones(2, 4), "offset": torch.zeros(2, 4)}, FP)
    nan = save_artifact(tmp_path / "nan.safetensors", "qada_correction",
                        {"slope": torch.full((3, 4), float("nan")), "offset": torch.zeros(3, 4)}, FP)
    missing = save_artifact(tmp_path / "missing.safetensors", "qada_correction", {"slope": torch.ones(3, 4)}, FP)
    mask = save_artifact(tmp_path / "mask.safetensors", "head_mask", {"mask": torch.ones(3, 4, dtype=torch.bool)},
                         FP)
    for path, match in ((shape, r"shape \[3, 4\]"), (nan, "finite"), (missing, "missing tensor"),
                        (mask, "expected 'qada_correction'"), (tmp_path / "none.safetensors", "does not exist")):
        with pytest.raises(ArtifactError, match=match):
            load_qada_correction(path)
        with pytest.raises(ArtifactError, match=match):
            CalibratedQAdACriterion(correction=str(path))
    good_path = save_qada_correction(tmp_path / "good.safetensors", *good, FP)
    with pytest.raises(ArtifactError, match="made for another model"):
        load_qada_correction(good_path, {**FP, "num_heads": 8})
    with pytest.raises(ValueError, match=r"shape \[30, 9\] for this model"):
        CalibratedQAdACriterion(correction=str(good_path)).check_model(30, 9)


# --- calibration on a tiny model and the command line ----------------------------------------------------------


def _moments_spec(tmp_path):
    return json.dumps({"name": "stored", "length": 512, "cache_dir": str(tmp_path / "cache")})


def test_cli_calibrate_dense_decoding(tiny_model_dir, tmp_path, capsys):
    from qada.eval.calibrate import load_static_frequency
    from tests.bad_inputs import run_cli

    path, _ = tiny_model_dir
    out = tmp_path / "mask.safetensors"
    result = run_cli(["calibrate", "--tasks", "niah_single_1", "--length", "300", "--samples", "1",
                      "--dense-decoding", "--model", path, "--out", out], capsys)
    assert result.code == 0, result.err
    frequency, mask = load_static_frequency(out)
    assert frequency.shape == mask.shape == (2, 4) and 0 <= frequency.min() <= frequency.max() <= 1
    assert "static mask with 4 of 8 heads local" in result.out


def test_cli_calibrate_correction_and_use(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from qada.artifacts import model_fingerprint
    from tests.bad_inputs import run_cli

    path, _ = tiny_model_dir
    out = tmp_path / "corr.safetensors"
    result = run_cli(["calibrate", "--correction", "--moments", _moments_spec(tmp_path), "--tasks", "niah_single_1",
                      "--length", "300", "--samples", "2", "--model", path, "--out", out], capsys)
    assert result.code == 0, result.err
    assert "mean abs log error" in result.out and "qada_calibrated" in result.out
    model = AutoModelForCausalLM.from_pretrained(path)
    slope, offset, info = load_qada_correction(out, model_fingerprint(model.config, model))
    assert slope.shape == offset.shape == (2, 4) and not torch.equal(slope, torch.ones(2, 4))
    assert info.info["tasks"] == "niah_single_1" and info.info["n"] == 2 and info.info["tau_static"] == 0.6
    assert info.info["moments"]["name"] == "stored" and info.info["records"] > 0
    assert info.tensors["count"][0] == (2, 4)
    assert run_cli(["moments", "info", out], capsys).code == 0

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The pass key is 12345. " * 40 + "What is the pass key? The pass key is")
    spec = json.dumps({"name": "qada_calibrated", "correction": str(out)})
    result = run_cli(["generate", "--prompt-file", prompt, "--model", path, "--criterion", spec, "--moments",
                      _moments_spec(tmp_path), "--max-new-tokens", "3"], capsys)
    assert result.code == 0, result.err
    assert "sparsity" in result.out


def test_calibrated_qada_on_a_tiny_model_fits_better_than_plain(tiny_model_dir, tmp_path):
    """Fitted on the calibration prompts, the corrected estimate is closer to the exact bulk mass on them."""
    from transformers import AutoModelForCausalLM

    from qada.eval.calibrate import calibrate_qada_correction
    from qada.eval.tasks import TASKS

    path, tokenizer = tiny_model_dir
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    samples = TASKS.build("niah_single_1").generate(tokenizer, 300, 2, seed=0)
    moments = json.loads(_moments_spec(tmp_path))
    correction, recorded = calibrate_qada_correction(model, tokenizer, samples, moments, progress=False)
    assert recorded.estimate.shape == recorded.truth.shape == (recorded.t_bulk.numel(), 2, 4)
    assert recorded.abs_log_error(correction) < recorded.abs_log_error()
    assert recorded.abs_log_error((torch.ones(2, 4), torch.zeros(2, 4))) == pytest.approx(recorded.abs_log_error())


# --- the embedded model ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_correction_lowers_the_held_out_log_error_on_the_embedded_model():
    from qada.eval.calibrate import calibrate_qada_correction, collect_log_bulk_samples
    from qada.eval.tasks import TASKS
    from qada.models import load_model

    model, tokenizer = load_model(None)
    task = TASKS.build("niah_single_2")
    fitted_on = task.generate(tokenizer, 1536, 2, seed=0)
    held_out = task.generate(tokenizer, 1536, 2, seed=1)
    assert not {s.input for s in fitted_on} & {s.input for s in held_out}
    correction, recorded = calibrate_qada_correction(model, tokenizer, fitted_on, progress=False)
    test = collect_log_bulk_samples(model, tokenizer, held_out, progress=False)
    before, after = test.abs_log_error(), test.abs_log_error(correction)
    print(f"held-out mean |log A_bulk - estimate|: {before:.3f} plain, {after:.3f} corrected "
          f"(fitted: {recorded.abs_log_error():.3f} -> {recorded.abs_log_error(correction):.3f})")
    assert after < before


def test_quantile_offset_covers_the_truth_in_that_fraction_of_steps():
    """``quantile=q``: the corrected estimate is >= the exact mass in about a fraction q of the samples per head."""
    from qada.functional import apply_log_correction, fit_log_correction

    generator = torch.Generator().manual_seed(0)
    n, L, H = 2000, 2, 3
    x = torch.randn(n, L, H, generator=generator, dtype=torch.float64)
    y = 0.7 * x + 0.3 + 0.5 * torch.randn(n, L, H, generator=generator, dtype=torch.float64)
    log_t = torch.zeros(n, 1, 1, dtype=torch.float64)
    for q in (0.5, 0.9):
        fit = fit_log_correction(x, y, log_t, ridge=0.0, quantile=q)
        corrected = apply_log_correction(x, x, fit.slope.double(), fit.offset.double())
        covered = (corrected >= y).double().mean(0)
        assert torch.allclose(covered, torch.full_like(covered, q), atol=0.01)
    mean_fit = fit_log_correction(x, y, log_t, ridge=0.0)
    high = fit_log_correction(x, y, log_t, ridge=0.0, quantile=0.9)
    assert (high.offset > mean_fit.offset).all(), "a high quantile is conservative: more estimated bulk"
    with pytest.raises(ValueError, match="quantile"):
        fit_log_correction(x, y, log_t, quantile=1.0)
