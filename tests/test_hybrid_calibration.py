"""Calibration and layer-indexed criteria on hybrid models (sliding-window layers beside global ones).

Only the global layers are decided, so static frequencies of sliding layers are NaN, alpha is a fraction of the
global heads, a correction fit gives sliding layers the identity, and budgets spread over the global layers.
"""

import math

import pytest
import torch

from qada.artifacts import ArtifactError, load_qada_correction, model_fingerprint, save_artifact
from qada.criteria import (
    CRITERIA,
    AllOf,
    BudgetedQAdACriterion,
    CalibratedQAdACriterion,
    DenseCriterion,
    HybridCriterion,
    StaticCalibrator,
    StaticCriterion,
)
from qada.eval.calibrate import (
    LogBulkRecorder,
    calibrate_qada_correction,
    calibrate_static,
    load_static_frequency,
    save_qada_correction_fit,
    save_static_frequency,
)
from qada.eval.tasks import Sample
from qada.functional import calibrate_static_mask, static_local_count
from qada.models import apply
from qada.models.layer_types import layer_types
from qada.step import DecodeStep
from qada.window import Window

NAN = float("nan")
GLOBAL = [2, 5]  # the tiny Gemma-3's global layers (two sliding layers, then one global, twice)


def _gemma3(vocab_size: int = 128):
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, max_position_embeddings=1024)
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def hybrid():
    """``(model, tokenizer, samples)``: the tiny hybrid Gemma-3 with the embedded model's tokenizer and two
    synthetic prompts of about 260 tokens (longer than the default 128-token window: every decode has a bulk)."""
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory

    tokenizer = AutoTokenizer.from_pretrained(model_directory(None))
    model = _gemma3(len(tokenizer))
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    g = torch.Generator().manual_seed(0)
    samples = [Sample("synthetic", i, " ".join(words[j] for j in torch.randint(0, 12, (200,), generator=g).tolist()),
                      ["beta gamma"], tokens_to_generate=6) for i in range(2)]
    assert layer_types(model).global_layers == GLOBAL
    return model, tokenizer, samples


def _decode(model, tokenizer, samples, **components):
    with apply(model, tokenizer=tokenizer, **components) as run:
        ids = tokenizer(samples[0].input, return_tensors="pt", add_special_tokens=False).input_ids
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    return run.summary()


# --- static masks over the global layers ---------------------------------------------------------------------------


def _hybrid_frequency() -> torch.Tensor:
    frequency = torch.full((6, 4), NAN)
    frequency[2] = torch.tensor([0.9, 0.1, 0.5, 0.5])
    frequency[5] = torch.tensor([0.5, 1.0, 0.0, 0.2])
    return frequency


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 0.5, 0.8, 1.0])
def test_static_mask_ranks_only_the_global_layers(alpha):
    frequency = _hybrid_frequency()
    mask = calibrate_static_mask(frequency, alpha)
    count = static_local_count(alpha, len(GLOBAL), 4)  # round(alpha G H), not round(alpha L H)
    assert mask[GLOBAL].sum() == count
    sliding = [layer for layer in range(6) if layer not in GLOBAL]
    assert mask[sliding].all()  # never used: those layers pass through
    # the global rows are ranked exactly as a two-layer model with those frequencies
    assert torch.equal(mask[GLOBAL], calibrate_static_mask(frequency[GLOBAL], alpha))
    criterion = StaticCriterion.from_frequency(frequency, alpha)
    criterion.bind_layers(GLOBAL)
    assert criterion.sparsity == pytest.approx(count / 8)


def test_static_mask_refuses_partly_nan_rows_inf_and_all_nan():
    frequency = _hybrid_frequency()
    frequency[2, 1] = NAN  # a global layer with one head missing: not a sliding layer
    with pytest.raises(ValueError, match="finite"):
        calibrate_static_mask(frequency, 0.5)
    frequency = _hybrid_frequency()
    frequency[5, 0] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        calibrate_static_mask(frequency, 0.5)
    with pytest.raises(ValueError, match="finite"):
        calibrate_static_mask(torch.full((3, 4), NAN), 0.5)


def test_static_calibrator_with_global_layers():
    calibrator = StaticCalibrator(6, 4, 0.6, global_layers=GLOBAL)
    calibrator.update(2, torch.tensor([[True, False, True, False], [True, False, False, False]]))
    with pytest.raises(RuntimeError, match=r"no decode steps recorded for layer\(s\) \[5\]"):
        calibrator.compute()  # a missing global layer still raises
    calibrator.update(5, torch.tensor([[False, True, True, True], [False, True, False, False]]))
    with pytest.raises(ValueError, match="sliding-window layer is never decided"):
        calibrator.update(1, torch.ones(1, 4, dtype=torch.bool))
    frequency = calibrator.compute()
    assert torch.isnan(frequency[[0, 1, 3, 4]]).all()
    torch.testing.assert_close(frequency[GLOBAL], torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 0.5, 0.5]]))
    mask = calibrator.static_criterion(0.5).mask  # 4 of the 8 global heads
    assert mask[GLOBAL].tolist() == [[True, False, True, False], [False, True, True, False]]
    other = StaticCalibrator(6, 4, 0.6, global_layers=[5, 2, 2])  # normalised: sorted, unique
    assert other.global_layers == GLOBAL
    other.merge(calibrator)
    with pytest.raises(ValueError, match="global_layers"):
        calibrator.merge(StaticCalibrator(6, 4, 0.6))
    with pytest.raises(ValueError, match="at least one global layer"):
        StaticCalibrator(6, 4, global_layers=[])
    with pytest.raises(ValueError, match="layer indices"):
        StaticCalibrator(6, 4, global_layers=[2, 6])


def test_all_global_calibration_is_unchanged():
    frequency = torch.rand(3, 5, generator=torch.Generator().manual_seed(1))
    plain = StaticCalibrator(3, 5)
    listed = StaticCalibrator(3, 5, global_layers=[0, 1, 2])
    for layer in range(3):
        local = frequency[layer][None] > 0.5
        plain.update(layer, local)
        listed.update(layer, local)
    assert torch.equal(plain.compute(), listed.compute())
    assert torch.equal(plain.static_criterion(0.4).mask, listed.static_criterion(0.4).mask)
    ranked = sorted((-frequency[l, h].item(), l, h) for l in range(3) for h in range(5))
    expected = torch.zeros(3, 5, dtype=torch.bool)
    for _, l, h in ranked[:6]:
        expected[l, h] = True
    assert torch.equal(calibrate_static_mask(frequency, 0.4), expected)


def test_calibrate_static_on_a_hybrid_model_and_the_run_sparsity(hybrid, tmp_path):
    model, tokenizer, samples = hybrid
    frequency = calibrate_static(model, tokenizer, samples, progress=False)
    assert frequency.shape == (6, 4)
    sliding = [0, 1, 3, 4]
    assert torch.isnan(frequency[sliding]).all()
    assert torch.isfinite(frequency[GLOBAL]).all() and 0 <= frequency[GLOBAL].min() <= frequency[GLOBAL].max() <= 1
    dense_frequency = calibrate_static(model, tokenizer, samples, decode_with_oracle=False, progress=False)
    assert torch.isnan(dense_frequency[sliding]).all() and torch.isfinite(dense_frequency[GLOBAL]).all()

    path = save_static_frequency(tmp_path / "static.safetensors", frequency, model, alpha=0.5)
    loaded, mask = load_static_frequency(path, model)
    assert torch.equal(loaded.isnan(), frequency.isnan()) and torch.equal(loaded[GLOBAL], frequency[GLOBAL])
    assert mask[GLOBAL].sum() == 4 and mask[sliding].all()

    for alpha in (0.5, 0.3):
        criterion = StaticCriterion.from_frequency(loaded, alpha)
        summary = _decode(model, tokenizer, samples, criterion=criterion, moments="none")
        expected = static_local_count(alpha, 2, 4) / 8  # alpha over the global heads: 4/8, then round(2.4)/8
        assert summary["sparsity"] == pytest.approx(expected)
        assert sorted(summary["sparsity_per_layer"]) == GLOBAL
        assert summary["sparsity_all_layers"] == pytest.approx((expected * 2 + 4) / 6)


def _artifact(tmp_path, model, frequency, mask=None, name="bad.safetensors"):
    mask = torch.ones(frequency.shape, dtype=torch.bool) if mask is None else mask
    return save_artifact(tmp_path / name, "head_mask", {"mask": mask, "frequency": frequency},
                         model_fingerprint(model.config))


def test_static_artifact_accepts_nan_rows_and_rejects_bad_ones(hybrid, tmp_path):
    model = hybrid[0]
    good = _artifact(tmp_path, model, _hybrid_frequency(), name="good.safetensors")
    assert torch.isnan(load_static_frequency(good, model)[0][0]).all()
    assert torch.isnan(load_static_frequency(good)[0][0]).all()  # without a model: shapes and values only
    partly = _hybrid_frequency()
    partly[2, 3] = NAN
    too_big = _hybrid_frequency()
    too_big[5, 0] = 1.5
    global_nan = _hybrid_frequency()
    global_nan[5] = NAN
    global_nan[4] = 0.5  # a NaN row at a global layer of this model (and numbers at a sliding one)
    cases = [
        (partly, None, "finite"),
        (too_big, None, r"in \[0, 1\]"),
        (torch.full((6, 4), NAN), None, "at least one layer"),
        (_hybrid_frequency(), torch.ones(6, 4), "bool"),
        (_hybrid_frequency()[:5], torch.ones(5, 4, dtype=torch.bool), r"shape \[6, 4\]"),
    ]
    for index, (frequency, mask, match) in enumerate(cases):
        path = _artifact(tmp_path, model, frequency, mask, name=f"bad{index}.safetensors")
        with pytest.raises(ArtifactError, match=match):
            load_static_frequency(path, model)
    path = _artifact(tmp_path, model, global_nan, name="global_nan.safetensors")
    load_static_frequency(path)  # well-formed on its own
    with pytest.raises(ArtifactError, match=r"layer\(s\) \[5\], which are global layers of this model"):
        load_static_frequency(path, model)
    with pytest.raises(ValueError, match="finite"):
        save_static_frequency(tmp_path / "partly.safetensors", partly, model, alpha=0.5)


def test_hybrid_criterion_from_a_hybrid_calibration(hybrid, tmp_path):
    model, tokenizer, samples = hybrid
    path = save_static_frequency(tmp_path / "static.safetensors", _hybrid_frequency(), model, alpha=0.5)
    criterion = HybridCriterion(base={"name": "qada", "tau": 0.6}, calibration=str(path), dense_fraction=0.25)
    always_dense = criterion.always_dense
    assert not always_dense[[0, 1, 3, 4]].any()  # sliding layers: never always dense (they pass through)
    # round(0.25 * 2 * 4) = 2 global heads with the lowest frequency: (5, 2) at 0.0, then (2, 1) at 0.1
    assert always_dense[GLOBAL].tolist() == [[False, True, False, False], [False, False, True, False]]
    criterion.check_model(6, 4)
    summary = _decode(model, tokenizer, samples, criterion=criterion, moments="current")
    assert summary["sparsity"] <= 0.75 and sorted(summary["sparsity_per_layer"]) == GLOBAL
    full = CRITERIA.build({"name": "hybrid", "calibration": str(path), "dense_fraction": 1.0}).always_dense
    assert full[GLOBAL].all() and not full[[0, 1, 3, 4]].any()


# --- the calibrated-QAdA correction --------------------------------------------------------------------------------


def test_correction_fit_on_a_hybrid_model(hybrid, tmp_path):
    model, tokenizer, samples = hybrid
    for quantile in (None, 0.9):
        correction, recorded = calibrate_qada_correction(model, tokenizer, samples, moments="current",
                                                         progress=False, quantile=quantile)
        assert recorded.estimate.shape[1:] == (6, 4) and torch.isnan(recorded.estimate[:, [0, 1, 3, 4]]).all()
        assert torch.isfinite(correction.slope).all() and torch.isfinite(correction.offset).all()
        sliding = [0, 1, 3, 4]
        assert (correction.slope[sliding] == 1).all() and (correction.offset[sliding] == 0).all()
        assert (correction.count[sliding] == 0).all() and (correction.count[GLOBAL] > 0).all()
        assert math.isfinite(recorded.abs_log_error()) and math.isfinite(recorded.abs_log_error(correction))
    path = save_qada_correction_fit(tmp_path / "corr.safetensors", correction, model)
    slope, offset, _ = load_qada_correction(path, model_fingerprint(model.config, model))
    assert torch.equal(slope, correction.slope)
    summary = _decode(model, tokenizer, samples, criterion=CalibratedQAdACriterion(correction=str(path)),
                      moments="current")
    assert sorted(summary["sparsity_per_layer"]) == GLOBAL and summary["fail_safe"] == 0


def test_log_bulk_recorder_needs_a_global_layer():
    with pytest.raises(ValueError, match="at least one global layer"):
        LogBulkRecorder(4, global_layers=[])
    recorder = LogBulkRecorder(4, global_layers=[1, 3])
    with pytest.raises(RuntimeError, match="recorded decode steps"):
        recorder.samples()


# --- budgets spread over the global layers -------------------------------------------------------------------------


def _step(layer: int, H: int = 4) -> DecodeStep:
    g = torch.Generator().manual_seed(layer)
    return DecodeStep(torch.randn(1, H, 8, generator=g), torch.randn(1, 2, 200, 8, generator=g), 8**-0.5,
                      Window(32, 4), layer=layer)


@pytest.mark.parametrize("sparsity", [0.3, 0.45, 0.6, 0.85])
def test_budget_spreads_over_the_global_layers_once_bound(sparsity):
    criterion = BudgetedQAdACriterion(sparsity=sparsity)
    criterion.bind_layers(GLOBAL)
    counts = [criterion.local_count(_step(layer)) for layer in GLOBAL]
    assert sum(counts) == math.floor(sparsity * 4 * 2 + 0.5)  # the global layers' mean is the target
    groups = [criterion.group_count(_step(layer)) for layer in GLOBAL]
    assert sum(groups) == math.floor(sparsity * 2 * 2 + 0.5)
    criterion.bind_layers(range(6))  # an all-global model: the raw layer indices, as before binding
    fresh = BudgetedQAdACriterion(sparsity=sparsity)
    assert ([criterion.local_count(_step(layer)) for layer in range(6)]
            == [fresh.local_count(_step(layer)) for layer in range(6)])


def test_bind_layers_reaches_the_children_of_composites():
    budget = BudgetedQAdACriterion(sparsity=0.3)
    nested = HybridCriterion(base=AllOf([DenseCriterion(), budget]), dense_mask=torch.zeros(6, 4, dtype=torch.bool))
    nested.bind_layers(GLOBAL)
    assert budget.layer_ordinal(5) == 1 and budget.layer_ordinal(2) == 0
    DenseCriterion().bind_layers(GLOBAL)  # a plain criterion: nothing to do


def test_budgeted_run_on_a_hybrid_model(hybrid):
    model, tokenizer, samples = hybrid
    criterion = BudgetedQAdACriterion(sparsity=0.3)
    criterion.bind_layers(layer_types(model).global_layers)  # what check_run_fits does when a run is bound
    summary = _decode(model, tokenizer, samples, criterion=criterion, moments="current")
    assert summary["fail_safe"] == 0
    assert summary["sparsity"] == pytest.approx(2 / 8)  # round(0.3 * 4 * 2) heads over the two global layers


# --- the command line ----------------------------------------------------------------------------------------------


def test_cli_calibrate_a_hybrid_model(hybrid, tmp_path, capsys):
    from tests.bad_inputs import run_cli

    model, tokenizer, _ = hybrid
    directory = tmp_path / "gemma3"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    out = tmp_path / "mask.safetensors"
    result = run_cli(["calibrate", "--tasks", "niah_single_1", "--length", "300", "--samples", "1", "--alpha", "0.5",
                      "--model", directory, "--out", out], capsys)
    assert result.code == 0, result.err
    assert "static mask with 4 of 8 heads local of the 2 global layers [2, 5]" in result.out
    assert "nan" not in result.out
    frequency, mask = load_static_frequency(out, model)
    assert torch.isnan(frequency[[0, 1, 3, 4]]).all() and torch.isfinite(frequency[GLOBAL]).all()
    corr = tmp_path / "corr.safetensors"
    result = run_cli(["calibrate", "--correction", "--moments", "current", "--tasks", "niah_single_1", "--length",
                      "300", "--samples", "1", "--model", directory, "--out", corr], capsys)
    assert result.code == 0, result.err
    slope, offset, _ = load_qada_correction(corr)
    assert torch.isfinite(slope).all() and (slope[[0, 1, 3, 4]] == 1).all() and (offset[[0, 1, 3, 4]] == 0).all()


# --- the embedded hybrid model -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_static_calibration_on_gemma3_270m():
    from qada import load_model
    from qada.eval.tasks import TASKS

    model, tokenizer = load_model("gemma3-270m")
    global_layers = layer_types(model).global_layers
    assert global_layers == [5, 11, 17]
    samples = TASKS.build("niah_single_1").generate(tokenizer, 400, 1, 0)
    frequency = calibrate_static(model, tokenizer, samples, progress=False)
    sliding = [layer for layer in range(18) if layer not in global_layers]
    assert frequency.shape == (18, 4) and torch.isnan(frequency[sliding]).all()
    assert torch.isfinite(frequency[global_layers]).all()
    criterion = StaticCriterion.from_frequency(frequency, 0.5)
    assert criterion.mask[global_layers].sum() == 6 and criterion.mask[sliding].all()
    summary = _decode(model, tokenizer, samples, criterion=criterion, moments="none")
    assert summary["sparsity"] == pytest.approx(0.5)
