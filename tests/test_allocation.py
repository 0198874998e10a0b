"""Allocation of a budget across layers (issue 32): a static calibration's frequencies decide how many heads each
layer keeps local; the mean is the target, the score still picks which heads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

import qada
from qada.criteria import CRITERIA
from qada.eval.calibrate import save_static_frequency
from qada.functional.static import allocate_local_counts, calibrate_static_mask


@settings(max_examples=40, derandomize=True)
@given(seed=st.integers(0, 10_000), L=st.integers(1, 6), H_kv=st.integers(1, 4), G=st.integers(1, 3),
       sparsity=st.floats(0, 1))
def test_counts_keep_the_mean_and_follow_the_frequencies(seed, L, H_kv, G, sparsity):
    H = H_kv * G
    frequency = torch.rand(L, H, generator=torch.Generator().manual_seed(seed))
    counts = allocate_local_counts(frequency, sparsity)
    assert int(counts.sum()) == int(calibrate_static_mask(frequency, sparsity).sum())
    assert abs(int(counts.sum()) - sparsity * L * H) <= 0.5 + 1e-9
    assert ((counts >= 0) & (counts <= H)).all()
    groups = allocate_local_counts(frequency, sparsity, G)
    assert ((groups >= 0) & (groups <= H_kv)).all() and abs(int(groups.sum()) - sparsity * L * H_kv) <= 0.5 + 1e-9


@settings(max_examples=40, derandomize=True)
@given(seed=st.integers(0, 10_000), L=st.integers(1, 6), H=st.integers(1, 9), sparsity=st.floats(0, 1),
       weight=st.floats(0, 1))
def test_a_tempered_allocation_keeps_the_total_and_lies_between(seed, L, H, sparsity, weight):
    frequency = torch.rand(L, H, generator=torch.Generator().manual_seed(seed))
    full = allocate_local_counts(frequency, sparsity)
    tempered = allocate_local_counts(frequency, sparsity, weight=weight)
    assert abs(int(tempered.sum()) - float(weight * full.sum() + (1 - weight) * sparsity * L * H)) <= 0.5 + 1e-9
    even = sparsity * H
    low, high = torch.minimum(full.double(), torch.tensor(even)), torch.maximum(full.double(), torch.tensor(even))
    assert ((tempered >= torch.floor(low)) & (tempered <= torch.ceil(high))).all()
    assert torch.equal(allocate_local_counts(frequency, sparsity, weight=1.0), full)


def test_a_layer_that_needs_the_bulk_gets_fewer_local_heads():
    frequency = torch.tensor([[0.1, 0.2, 0.1, 0.0], [0.9, 0.95, 0.8, 0.99], [0.5, 0.6, 0.7, 0.4]])
    assert allocate_local_counts(frequency, 0.5).tolist() == [0, 4, 2]
    # groups of 2: a group is as local as its least local head
    assert allocate_local_counts(frequency, 0.5, 2).tolist() == [0, 2, 1]
    nan = frequency.clone()
    nan[0] = float("nan")  # a sliding layer of a hybrid model: not ranked
    assert allocate_local_counts(nan, 0.5).tolist()[1:] == [4, 0]
    with pytest.raises(ValueError, match="group size"):
        allocate_local_counts(frequency, 0.5, 3)
    # halfway between [0, 4, 2] and the even spread of 2 heads per layer
    assert allocate_local_counts(frequency, 0.5, weight=0.5).tolist() == [1, 3, 2]
    # 0.25 of the way: 1.5, 2.5, 2 -> cumulative 1.5, 4, 6 rounds to 2, 4, 6
    assert allocate_local_counts(frequency, 0.5, weight=0.25).tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="weight"):
        allocate_local_counts(frequency, 0.5, weight=1.5)


def _artifact(tmp_path, model, frequency):
    return str(save_static_frequency(tmp_path / "static.safetensors", frequency, model, alpha=0.5))


@pytest.mark.parametrize("name", ["qada_budget", "qada_tail_budget"])
@pytest.mark.parametrize("per_group", [False, True])
def test_the_budget_rule_keeps_each_layers_allocated_count(tmp_path, name, per_group):
    model = tiny_model("llama")
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    H_kv = model.config.num_key_value_heads
    frequency = torch.linspace(0, 1, L * H).reshape(L, H)  # later layers more local
    path = _artifact(tmp_path, model, frequency)
    criterion = {"name": name, "sparsity": 0.5, "allocation": path, "per_group": per_group}
    if name == "qada_tail_budget":
        criterion.update(heavy=4, observe=4, page_size=4, pages=2)
    counts = allocate_local_counts(frequency, 0.5, H // H_kv if per_group else 1)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), qada.apply(model, criterion=criterion, moments="current",
                                     window={"t_local": 8, "t_sink": 2}) as run:
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        summary = run.summary()
    per_layer = summary["sparsity_per_layer"]
    expected = counts.double() / (H_kv if per_group else H)
    assert sorted(per_layer) == list(range(L)) and len(set(expected.tolist())) > 1
    assert torch.allclose(torch.tensor([per_layer[layer] for layer in range(L)], dtype=torch.float64), expected,
                          atol=1e-6)


def test_an_allocation_of_another_model_is_refused(tmp_path):
    model = tiny_model("llama")
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    path = _artifact(tmp_path, model, torch.rand(L, H))
    other = torch.rand(L + 1, H)
    wrong = str(save_static_frequency(tmp_path / "other.safetensors", other, model, alpha=0.5))
    with pytest.raises(ValueError, match="allocation"):
        with qada.apply(model, criterion={"name": "qada_budget", "sparsity": 0.5, "allocation": wrong}):
            pass
    with pytest.raises(ValueError, match="allocation to be the path"):
        CRITERIA.build({"name": "qada_budget", "sparsity": 0.5, "allocation": 3})
    assert CRITERIA.build({"name": "qada_budget", "sparsity": 0.5, "allocation": path}).allocation == path
