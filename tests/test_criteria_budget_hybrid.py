"""Budgeted QAdA (``qada_budget``) and the hybrid criterion (``hybrid``): issue 16, parts 1 and 3."""

import math
from dataclasses import dataclass

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from qada.artifacts import ArtifactError, save_head_mask
from qada.criteria import (
    CRITERIA,
    AllOf,
    BudgetedQAdACriterion,
    HybridCriterion,
    OracleCriterion,
    QAdACriterion,
    StaticCriterion,
)
from qada.functional import calibrate_static_mask
from qada.moments import BulkMoments
from qada.step import DecodeStep
from qada.window import Window
from tests.helpers import population_moments, random_psd


def _step(b=2, H=6, H_kv=3, T=200, d=8, seed=0, layer=0, start=None, moments=None) -> DecodeStep:
    """A random step whose moments are those of its own bulk keys (finite scores everywhere)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, H_kv, T, d, generator=g) * 1.5
    query = torch.randn(b, H, d, generator=g) * 1.5
    window = Window(32, 4)
    if moments is None:
        moments = population_moments(keys[:, :, window.t_sink : T - (window.t_local - window.t_sink)])
    return DecodeStep(query, keys, d**-0.5, window, layer=layer, start=start, moments=moments)


@dataclass
class FixedScore(BudgetedQAdACriterion):
    """The budgeted decision on given scores (ties, NaN), the step's bulk/no-bulk rows and groups unchanged."""

    value: object = None

    def score(self, step):
        return self.value


def _kv_sparsity(local: torch.Tensor, G: int) -> torch.Tensor:
    """Fraction of (row, KV group) pairs whose query heads are all local: the bulk reads a decision skips."""
    b, H = local.shape
    return local.view(b, H // G, G).all(-1).float().mean()


# --- qada_budget --------------------------------------------------------------------------------------------
def test_the_score_is_qadas_estimated_local_share_and_needs_moments():
    step = _step()
    criterion = BudgetedQAdACriterion(sparsity=0.5)
    torch.testing.assert_close(criterion.score(step), step.log_local - step.log_bulk_estimate)
    assert criterion.needs() == {"moments": True, "full_scores": False, "calibration": False}
    assert "scores" not in vars(step), "the budgeted estimate must not compute the full scores"
    with pytest.raises(RuntimeError, match="no moment source"):
        criterion(DecodeStep(torch.randn(1, 2, 8), torch.randn(1, 1, 300, 8), 0.3))


@pytest.mark.parametrize("seed", range(5))
def test_at_qadas_own_count_the_budget_picks_qadas_heads(seed):
    step = _step(b=1, H=8, H_kv=2, seed=seed)
    qada = QAdACriterion(tau=0.6)(step)
    k = int(qada.sum())
    budget = BudgetedQAdACriterion(sparsity=k / 8)(step)
    assert torch.equal(budget, qada)


@pytest.mark.parametrize("sparsity", [0.0, 0.2, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_exactly_round_sparsity_h_heads_of_each_row_are_local(sparsity):
    for seed in range(4):
        step = _step(b=3, H=8, H_kv=4, seed=seed)
        local = BudgetedQAdACriterion(sparsity=sparsity)(step)
        assert local.dtype == torch.bool and local.shape == (3, 8)
        assert (local.sum(-1) == int(sparsity * 8 + 0.5)).all()
        score = step.log_local - step.log_bulk_estimate  # every local head scores at least every dense one
        assert (torch.where(local, score, torch.inf).amin(-1) >= torch.where(local, -torch.inf, score).amax(-1)).all()
        assert int(step.fail_safe) == 0


def test_ties_go_to_the_lower_head_and_group_index():
    step = _step(b=1, H=6, H_kv=3)
    score = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 0.0]])
    assert FixedScore(sparsity=2 / 6, value=score)(step).tolist() == [[False, True, True, False, False, False]]
    # group minima 1, 1, 0: one group -> the lower of the tied groups 0 and 1
    score = torch.tensor([[1.0, 2.0, 2.0, 1.0, 0.0, 0.0]])
    assert FixedScore(sparsity=1 / 3, per_group=True, value=score)(step).tolist() == [[True, True] + [False] * 4]
    # group minima 0, 1, 0: two groups -> group 1, then the lower of the tied groups 0 and 2
    score = torch.tensor([[0.0, 3.0, 1.0, 1.0, 0.0, 5.0]])
    assert FixedScore(sparsity=2 / 3, per_group=True, value=score)(step).tolist() == [[True] * 4 + [False] * 2]


def test_non_finite_scores_are_never_local_and_counted():
    step = _step(b=1, H=6, H_kv=3)
    score = torch.tensor([[float("nan"), 5.0, float("inf"), 1.0, 0.0, -1.0]])
    assert FixedScore(sparsity=0.5, value=score)(step).tolist() == [[False, True, False, True, True, False]]
    assert int(step.fail_safe) == 2
    # per group: groups 0 and 1 hold a non-finite head, so only group 2 can be local, whatever the budget
    step = _step(b=1, H=6, H_kv=3)
    assert FixedScore(sparsity=1.0, per_group=True, value=score)(step).tolist() == [[False] * 4 + [True] * 2]
    assert int(step.fail_safe) == 2  # the non-finite heads themselves, as per head
    # a non-finite estimate from the moments themselves: every head dense, all counted
    nan = BulkMoments(torch.full((2, 3, 8), float("nan")), torch.zeros(2, 3, 8, 8))
    for per_group in (False, True):
        step = _step(moments=nan)
        assert not BudgetedQAdACriterion(sparsity=1.0, per_group=per_group)(step).any()
        assert int(step.fail_safe) == 12


def test_rows_without_bulk_are_local_as_for_threshold_criteria():
    start = torch.tensor([0, 170])  # row 1 has 30 real tokens <= T_local = 32: no bulk
    for per_group in (False, True):
        step = _step(start=start)
        local = BudgetedQAdACriterion(sparsity=0.5, per_group=per_group)(step)
        assert local[1].all() and int(local[0].sum()) == (4 if per_group else 3)  # 2 of 3 groups / 3 of 6 heads
        assert int(step.fail_safe) == 0
        assert torch.equal(local[1], QAdACriterion(tau=1.0)(_step(start=start))[1])
    nan = BulkMoments(torch.full((1, 1, 8), float("nan")), torch.zeros(1, 1, 8, 8))
    short = DecodeStep(torch.randn(1, 2, 8), torch.randn(1, 1, 100, 8), 0.3, moments=nan)  # T < 128
    assert BudgetedQAdACriterion(sparsity=0.0)(short).all() and int(short.fail_safe) == 0


def test_per_group_keeps_whole_groups_and_skips_at_least_as_many_bulk_reads():
    for seed in range(20):
        for H_kv, G in ((1, 4), (2, 3), (3, 3), (4, 2)):
            H = H_kv * G
            for sparsity in (0.25, 0.5, 0.75, 0.9):
                step = _step(b=2, H=H, H_kv=H_kv, seed=seed)
                grouped = BudgetedQAdACriterion(sparsity=sparsity, per_group=True)(step)
                per_head = BudgetedQAdACriterion(sparsity=sparsity)(step)
                by_group = grouped.view(2, H_kv, G)
                assert (by_group.all(-1) | ~by_group.any(-1)).all(), "a group is local only as a whole"
                assert (by_group.all(-1).sum(-1) == int(sparsity * H_kv + 0.5)).all()
                assert _kv_sparsity(grouped, G) >= _kv_sparsity(per_head, G)


def test_per_group_ranks_a_group_by_its_least_local_head():
    step = _step(b=1, H=4, H_kv=2)
    score = torch.tensor([[9.0, -5.0, 1.0, 0.5]])  # group 0 has the best head but also the worst
    assert FixedScore(sparsity=0.5, per_group=True, value=score)(step).tolist() == [[False, False, True, True]]


def test_budget_parameters_are_checked():
    for bad in (-0.1, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match=r"expected sparsity in \[0, 1\]"):
            BudgetedQAdACriterion(sparsity=bad)
    with pytest.raises(ValueError, match="expected per_group to be a bool"):
        CRITERIA.build("qada_budget", per_group="yes")
    with pytest.raises(ValueError, match="unknown parameter"):
        CRITERIA.build("qada_budget", tau=0.6)


def test_budget_config_round_trip():
    criterion = CRITERIA.build({"name": "qada_budget", "sparsity": 0.75, "per_group": True})
    config = criterion.to_config()
    assert config == {"name": "qada_budget", "sparsity": 0.75, "per_group": True, "allocation": None,
                      "allocation_weight": 1.0}
    rebuilt = CRITERIA.build(yaml.safe_load(yaml.safe_dump(config)))
    assert rebuilt.to_config() == config and torch.equal(rebuilt(_step()), criterion(_step()))


# --- hybrid -------------------------------------------------------------------------------------------------
def _random_dense_mask(L, H, seed):
    return torch.rand(L, H, generator=torch.Generator().manual_seed(seed)) < 0.3


@pytest.mark.parametrize(
    "base", [{"name": "qada", "tau": 0.6}, {"name": "qada_budget", "sparsity": 0.75}, "oracle", "local"]
)
def test_hybrid_equals_all_of_static_and_base(base):
    L, H = 4, 6
    for seed in range(3):
        dense = _random_dense_mask(L, H, seed)
        dense[1] = True  # a layer entirely dense (the base is skipped there)
        hybrid = CRITERIA.build({"name": "hybrid", "base": base, "dense_mask": dense.tolist()})
        composed = CRITERIA.build({"name": "all_of", "criteria": [{"name": "static", "mask": (~dense).tolist()}, base]})
        for layer in range(L):
            start = torch.tensor([0, 60, 175])  # the last row has no bulk
            local = hybrid(_step(b=3, H=H, seed=seed, layer=layer, start=start))
            assert torch.equal(local, composed(_step(b=3, H=H, seed=seed, layer=layer, start=start)))
            assert not local[:, dense[layer]].any()


def test_hybrid_needs_follow_the_base():
    mask = [[False, True]]
    assert HybridCriterion(dense_mask=mask).needs() == {"moments": True, "full_scores": False, "calibration": True}
    oracle = HybridCriterion(base=OracleCriterion(0.5), dense_mask=mask)
    assert oracle.needs() == {"moments": False, "full_scores": True, "calibration": True}
    assert HybridCriterion(base="qada_budget", dense_mask=mask).needs_moments
    assert not HybridCriterion(base="local", dense_mask=mask).needs_moments


def test_an_all_dense_layer_is_dense_whatever_the_base_says():
    """The base decides on every layer (one compiled step serves them all); the always-dense heads win."""
    from qada.moments import BulkMoments

    hybrid = HybridCriterion(base="local", dense_mask=[[True, True], [False, True]])
    keys = torch.randn(2, 1, 300, 8)
    moments = BulkMoments(keys.mean(2), torch.eye(8).expand(2, 1, 8, 8))
    assert not hybrid(DecodeStep(torch.randn(2, 2, 8), keys, 0.3, layer=0, moments=moments)).any()
    assert hybrid(DecodeStep(torch.randn(2, 2, 8), keys, 0.3, layer=1, moments=moments)).tolist() == [[True, False]] * 2


def _fake_model(L, H):
    from types import SimpleNamespace

    from transformers import LlamaConfig

    return SimpleNamespace(
        config=LlamaConfig(
            num_hidden_layers=L,
            num_attention_heads=H,
            num_key_value_heads=H // 2,
            hidden_size=8 * H,
            intermediate_size=16,
        )
    )


def test_hybrid_from_a_calibration_artifact(tmp_path):
    from qada.eval.calibrate import save_static_frequency

    L, H = 3, 4
    frequency = torch.tensor([[0.9, 0.1, 0.5, 0.1], [0.0, 1.0, 0.1, 0.7], [0.3, 0.3, 0.95, 0.0]])
    path = save_static_frequency(tmp_path / "static.safetensors", frequency, _fake_model(L, H), alpha=0.5)
    hybrid = CRITERIA.build({"name": "hybrid", "calibration": str(path), "dense_fraction": 0.5})
    # the 6 lowest frequencies: 0.0 (1,0), 0.0 (2,3), then the 0.1 ties in (layer, head) order (0,1), (0,3), (1,2)
    # and 0.3 at (2,0) before the tied 0.3 at (2,1)
    expected = torch.zeros(L, H, dtype=torch.bool)
    for layer, head in ((1, 0), (2, 3), (0, 1), (0, 3), (1, 2), (2, 0)):
        expected[layer, head] = True
    assert torch.equal(hybrid.always_dense, expected)
    assert torch.equal(hybrid.always_dense, calibrate_static_mask(-frequency, 0.5))
    assert not CRITERIA.build({"name": "hybrid", "calibration": str(path), "dense_fraction": 0.0}).always_dense.any()
    assert CRITERIA.build({"name": "hybrid", "calibration": str(path), "dense_fraction": 1.0}).always_dense.all()
    hybrid.check_model(L, H)
    config = hybrid.to_config()
    assert config == {
        "name": "hybrid",
        "base": {"name": "qada", "tau": 0.6},
        "dense_mask": None,
        "calibration": str(path),
        "dense_fraction": 0.5,
    }
    rebuilt = CRITERIA.build(yaml.safe_load(yaml.safe_dump(config)))
    assert rebuilt.to_config() == config
    composed = AllOf([StaticCriterion(~expected), QAdACriterion(0.6)])
    for layer in range(L):
        assert torch.equal(rebuilt(_step(H=H, H_kv=2, layer=layer)), composed(_step(H=H, H_kv=2, layer=layer)))
    # a plain head mask (no frequencies) cannot say which heads are least local
    plain = save_head_mask(tmp_path / "mask.safetensors", expected, {"num_layers": L, "num_heads": H})
    with pytest.raises(ArtifactError, match="missing tensor"):
        HybridCriterion(calibration=str(plain), dense_fraction=0.5)


def test_hybrid_config_round_trip_with_a_mask():
    hybrid = CRITERIA.build(
        {
            "name": "hybrid",
            "base": {"name": "qada_budget", "sparsity": 0.75, "per_group": True},
            "dense_mask": [[1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]],
        }
    )
    config = hybrid.to_config()
    assert config["dense_mask"] == [[True] + [False] * 5, [False] * 5 + [True]]
    assert config["base"] == {"name": "qada_budget", "sparsity": 0.75, "per_group": True, "allocation": None,
                              "allocation_weight": 1.0}
    rebuilt = CRITERIA.build(yaml.safe_load(yaml.safe_dump(config)))
    assert rebuilt.to_config() == config
    assert torch.equal(rebuilt(_step(layer=1)), hybrid(_step(layer=1)))


def test_hybrid_parameters_are_checked(tmp_path):
    with pytest.raises(ValueError, match="exactly one of dense_mask .* but got neither"):
        CRITERIA.build("hybrid")
    with pytest.raises(ValueError, match="exactly one of dense_mask .* but got both"):
        HybridCriterion(dense_mask=[[True]], calibration="x.safetensors", dense_fraction=0.5)
    with pytest.raises(ValueError, match="dense_fraction only with calibration"):
        HybridCriterion(dense_mask=[[True]], dense_fraction=0.5)
    with pytest.raises(ValueError, match=r"expected dense_fraction in \[0, 1\] with calibration but got None"):
        HybridCriterion(calibration="x.safetensors")
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match=r"expected dense_fraction in \[0, 1\]"):
            HybridCriterion(calibration="x.safetensors", dense_fraction=bad)
    with pytest.raises(ValueError, match="not found|does not exist|could not|No such file"):
        HybridCriterion(calibration=str(tmp_path / "missing.safetensors"), dense_fraction=0.5)
    with pytest.raises(ValueError, match=r"shape \[layers, heads\]"):
        HybridCriterion(dense_mask=[True, False])
    with pytest.raises(ValueError, match="booleans"):
        HybridCriterion(dense_mask=[[0.5, 1.0]])
    with pytest.raises(ValueError, match="the path"):
        HybridCriterion(dense_mask="mask.safetensors")
    with pytest.raises(ValueError, match="unknown criterion|no criterion|expected one of|not registered"):
        HybridCriterion(base="no_such_criterion", dense_mask=[[True]])


def test_hybrid_mask_of_the_wrong_shape_fails_at_check_model():
    hybrid = HybridCriterion(dense_mask=[[True, False, False]] * 2)
    hybrid.check_model(2, 3)
    with pytest.raises(ValueError, match=r"dense_mask of shape \[30, 9\] for this model but got \[2, 3\]"):
        hybrid.check_model(30, 9)
    with pytest.raises(ValueError, match="does not fit layer 2"):
        hybrid(_step(H=3, H_kv=1, layer=2))
    inner = HybridCriterion(base={"name": "static", "mask": [[True, False, False]]}, dense_mask=[[False] * 3] * 2)
    with pytest.raises(ValueError, match="static mask of shape"):
        inner.check_model(2, 3)  # the base is checked too


# --- properties -----------------------------------------------------------------------------------------------
_shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4))  # b, H_kv, G


@settings(deadline=None, max_examples=60)
@given(_shapes, st.floats(0, 1), st.floats(0, 1), st.booleans(), st.integers(0, 2**31 - 1))
def test_budget_properties(shape, s1, s2, per_group, seed):
    b, H_kv, G = shape
    H = H_kv * G
    low, high = sorted((s1, s2))
    step = _step(b=b, H=H, H_kv=H_kv, seed=seed)
    small = BudgetedQAdACriterion(sparsity=low, per_group=per_group)(step)
    large = BudgetedQAdACriterion(sparsity=high, per_group=per_group)(step)
    assert not (small & ~large).any(), "a higher sparsity keeps every head a lower one keeps"
    if per_group:
        by_group = small.view(b, H_kv, G)
        assert (by_group.all(-1) | ~by_group.any(-1)).all()
        assert (by_group.all(-1).sum(-1) == int(low * H_kv + 0.5)).all()
    else:
        assert (small.sum(-1) == int(low * H + 0.5)).all()
        assert (large.sum(-1) == int(high * H + 0.5)).all()
    assert int(step.fail_safe) == 0


@settings(deadline=None, max_examples=60)
@given(_shapes, st.integers(1, 3), st.floats(0, 1), st.booleans(), st.integers(0, 2**31 - 1))
def test_hybrid_properties(shape, L, tau, budgeted, seed):
    b, H_kv, G = shape
    H = H_kv * G
    dense = _random_dense_mask(L, H, seed)
    base = {"name": "qada_budget", "sparsity": tau} if budgeted else {"name": "qada", "tau": tau}
    hybrid = HybridCriterion(base=base, dense_mask=dense)
    for layer in range(L):
        local = hybrid(_step(b=b, H=H, H_kv=H_kv, seed=seed, layer=layer))
        base_local = CRITERIA.build(base)(_step(b=b, H=H, H_kv=H_kv, seed=seed, layer=layer))
        assert not (local & ~base_local).any(), "local only where the base says local"
        assert not local[:, dense[layer]].any(), "an always-dense head is never local"
        assert torch.equal(local, base_local & ~dense[layer])


@settings(deadline=None, max_examples=30)
@given(st.integers(2, 12), st.integers(0, 2**31 - 1))
def test_budget_on_psd_moments_counts_exactly(d, seed):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(1, 2, d, generator=g, dtype=torch.float64)
    moments = BulkMoments(mean, random_psd(d, g)[None, None].expand(1, 2, d, d))
    step = _step(b=1, H=6, H_kv=2, d=d, seed=seed, moments=moments)
    assert int(BudgetedQAdACriterion(sparsity=0.5)(step).sum()) == 3


# --- the embedded model ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_budget_and_hybrid_on_the_embedded_model():
    from qada.eval.passkey import passkey_prompt
    from qada.models import apply, load_model

    model, tokenizer = load_model(None)
    prompt = passkey_prompt(tokenizer, 2048, 0.6, seed=0)  # dense finds this key

    def answer(criterion):
        with apply(model, tokenizer=tokenizer, criterion=criterion) as run:
            out = model.generate(
                prompt.input_ids,
                attention_mask=torch.ones_like(prompt.input_ids),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        return tokenizer.decode(out[0, prompt.length :]), run.summary()

    from qada.criteria import spread_count

    def spread(per_layer: float, width: int) -> float:  # the budget spread over the 30 layers
        return sum(spread_count(per_layer, layer) for layer in range(30)) / (30 * width)

    _, summary = answer({"name": "qada_budget", "sparsity": 0.75})
    assert summary["sparsity"] == pytest.approx(spread(0.75 * 9, 9))  # 203 of 270 heads: 0.752
    assert summary["fail_safe"] == 0
    _, grouped = answer({"name": "qada_budget", "sparsity": 0.75, "per_group": True})
    groups = spread(0.75 * 3, 3)  # 68 of 90 KV groups
    assert grouped["sparsity"] == pytest.approx(groups) and grouped["kv_sparsity"] == pytest.approx(groups)
    assert grouped["kv_sparsity"] > summary["kv_sparsity"]
    dense = [[True] * 9] + [[False] * 9] * 29  # layer 0 always dense, QAdA on the rest
    text, hybrid = answer({"name": "hybrid", "base": {"name": "qada", "tau": 0.6}, "dense_mask": dense})
    assert hybrid["sparsity_per_layer"][0] == 0.0 and hybrid["sparsity"] > 0.3
    assert prompt.key in text, f"hybrid answered {text!r}"


@given(st.floats(0, 1), st.integers(1, 64), st.integers(1, 80))
def test_spread_count_reaches_the_fractional_budget_over_layers(sparsity, heads, layers):
    from qada.criteria import spread_count

    target = sparsity * heads
    counts = [spread_count(target, layer) for layer in range(layers)]
    assert all(math.floor(target) <= c <= math.ceil(target) for c in counts)
    assert abs(sum(counts) - target * layers) <= 0.5 + 1e-9
    if float(target).is_integer():
        assert counts == [int(target)] * layers
