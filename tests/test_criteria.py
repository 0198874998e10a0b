import pytest
import torch
import yaml

from qada.criteria import (
    CRITERIA,
    AllOf,
    AnyOf,
    DenseCriterion,
    HeadCriterion,
    LayerOverride,
    LocalCriterion,
    Not,
    OracleCriterion,
    QAdACriterion,
    StaticCriterion,
    StepContext,
)
from qada.moments import BulkMoments
from qada.window import Window
from tests.helpers import population_moments

# One example configuration per registered criterion: a new criterion without an entry fails the matrix test.
EXAMPLES = {
    "dense": {},
    "local": {},
    "oracle": {"tau": 0.7},
    "qada": {"tau": 0.4},
    "static": {"mask": [[True, False, True, False]] * 3},
    "any_of": {"criteria": [{"name": "oracle", "tau": 0.9}, "qada"]},
    "all_of": {"criteria": [{"name": "oracle"}, {"name": "qada", "tau": 0.2}]},
    "not": {"criterion": {"name": "oracle", "tau": 0.5}},
    "layer_override": {"base": {"name": "qada", "tau": 0.6}, "overrides": {0: "dense", 2: {"name": "local"}}},
    "qada_calibrated": {"tau": 0.5, "slope": [[1.2, 0.8, 1.0, 0.5]] * 3, "offset": [[0.3, -0.2, 0.0, 1.0]] * 3},
    "qada_budget": {"sparsity": 0.5, "per_group": True},
    "hybrid": {"base": {"name": "qada_budget", "sparsity": 0.75}, "dense_mask": [[True, False, False, False]] * 3},
    "qada_tail": {"tau": 0.5, "heavy": 8, "page_size": 16, "pages": 2},
    "qada_tail_budget": {"sparsity": 0.5, "heavy": 0, "page_size": 32, "pages": 1},
    "quest": {"pages": 2, "page_size": 16},
}


def make_ctx(layer=0, seed=0, T=300, b=2):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, 2, T, 16, generator=g) * 2
    query = torch.randn(b, 4, 16, generator=g) * 2
    window = Window(32, 4)
    return StepContext(
        query, keys, 0.25, window, layer=layer, moments=population_moments(keys[:, :, 4 : T - 28])
    )


def test_every_registered_criterion_has_an_example():
    assert sorted(EXAMPLES) == CRITERIA.names()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_criterion_builds_decides_and_round_trips(name):
    criterion = CRITERIA.build(name, **EXAMPLES[name])
    assert isinstance(criterion, HeadCriterion)
    config = criterion.to_config()
    assert config["name"] == name
    rebuilt = CRITERIA.build(yaml.safe_load(yaml.safe_dump(config)))
    assert rebuilt.to_config() == config
    for layer in range(3):
        ctx = make_ctx(layer)
        for built in (criterion, rebuilt):  # what a run does at the prefill (no-op but for stateful criteria)
            built.observe_prefill(layer, ctx.keys, None, ctx.scale, None, ctx.window)
        local = criterion(ctx)
        assert local.dtype == torch.bool and local.shape == (2, 4)
        assert torch.equal(local, rebuilt(make_ctx(layer)))


def test_baselines():
    ctx = make_ctx()
    assert not DenseCriterion()(ctx).any()
    assert LocalCriterion()(ctx).all()


def test_composition_logic():
    ctx = make_ctx(seed=3)
    a, b = OracleCriterion(0.3), QAdACriterion(0.8)
    assert torch.equal(AnyOf([a, b])(ctx), a(ctx) | b(ctx))
    assert torch.equal(AllOf([a, b])(ctx), a(ctx) & b(ctx))
    assert torch.equal(Not(a)(ctx), ~a(ctx))
    override = LayerOverride(LocalCriterion(), {0: "dense"})
    assert not override(make_ctx(layer=0)).any()
    assert override(make_ctx(layer=1)).all()


def test_composites_declare_what_their_children_need():
    assert OracleCriterion.needs_full_scores and not OracleCriterion.needs_moments
    assert QAdACriterion.needs_moments and not QAdACriterion.needs_full_scores
    assert AnyOf([OracleCriterion(), "local"]).needs_full_scores
    assert not AnyOf([OracleCriterion(), "local"]).needs_moments
    assert LayerOverride("dense", {3: "qada"}).needs_moments
    assert not LayerOverride("dense", {3: "local"}).needs_moments


def test_needs_are_served_lazily():
    ctx = make_ctx()
    QAdACriterion()(ctx)
    assert "scores" not in vars(ctx), "QAdA must not compute the full scores"
    OracleCriterion()(ctx)
    assert "scores" in vars(ctx)
    calls = []

    def provider():
        calls.append(1)
        return population_moments(ctx.keys[:, :, 4:272])

    lazy = StepContext(ctx.query, ctx.keys, 0.25, ctx.window, moments=provider)
    OracleCriterion()(lazy)
    assert calls == []
    QAdACriterion()(lazy)
    QAdACriterion(0.2)(lazy)
    assert calls == [1]


def test_qada_without_moments_says_so():
    ctx = StepContext(torch.randn(1, 2, 8), torch.randn(1, 2, 300, 8), 0.3)
    with pytest.raises(RuntimeError, match="no moment source"):
        QAdACriterion()(ctx)


def test_non_finite_estimate_is_dense_and_counted():
    ctx = make_ctx()
    nan_moments = BulkMoments(torch.full((2, 2, 16), float("nan")), torch.zeros(2, 2, 16, 16))
    bad = StepContext(ctx.query, ctx.keys, 0.25, ctx.window, moments=nan_moments)
    assert not QAdACriterion(0.0)(bad).any()
    assert bad.fail_safe.item() == 8
    huge = BulkMoments(torch.zeros(2, 2, 16), torch.eye(16).expand(2, 2, 16, 16) * 1e38)
    overflow = StepContext(ctx.query, ctx.keys, 0.25, ctx.window, moments=huge)
    assert not QAdACriterion(0.0)(overflow).any()


def test_short_rows_are_trivially_local():
    ctx = StepContext(torch.randn(1, 2, 8), torch.randn(1, 1, 100, 8), 0.3, Window(128, 16))
    assert OracleCriterion(1.0)(ctx).all()
    moments = BulkMoments(torch.full((1, 1, 8), float("nan")), torch.zeros(1, 1, 8, 8))
    ctx = StepContext(torch.randn(1, 2, 8), torch.randn(1, 1, 100, 8), 0.3, moments=moments)
    assert QAdACriterion(1.0)(ctx).all()


def test_tau_one_and_zero():
    ctx = make_ctx()
    assert OracleCriterion(0.0)(ctx).all() and QAdACriterion(0.0)(ctx).all()
    assert not OracleCriterion(1.0)(ctx).any()


def test_static_mask_per_layer():
    mask = torch.tensor([[True, False, True, False], [False, False, False, True]])
    criterion = StaticCriterion(mask)
    assert torch.equal(criterion(make_ctx(layer=1)), mask[1].expand(2, 4))
    with pytest.raises(ValueError, match="does not fit layer 2"):
        criterion(make_ctx(layer=2))
    with pytest.raises(ValueError, match=r"shape \[layers, heads\]"):
        StaticCriterion([True, False])
    with pytest.raises(ValueError, match="booleans"):
        StaticCriterion([[0.5, 1.0]])


def test_bad_criterion_output_is_caught():
    class Broken(HeadCriterion):
        def decide(self, ctx):
            return torch.ones(3, dtype=torch.bool)

    with pytest.raises(ValueError, match=r"must return a bool tensor of shape \[2, 4\]"):
        Broken()(make_ctx())
