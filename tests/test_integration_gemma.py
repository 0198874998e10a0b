"""Integration on the second embedded model, Gemma-3-270M (hybrid attention, 32k positions), offline.

Its 15 sliding-window layers (512 tokens) pass through untouched; qada decides on the global layers 5, 11, 17.
Prompts are longer than the window, so the sliding layers really slide.
"""

import json

import pytest
import torch

from qada.eval.passkey import passkey_prompt
from qada.models import apply, load_model
from qada.models.generation import make_cache
from qada.models.layer_types import layer_types

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


def test_gemma_loads_offline_as_a_hybrid_model(gemma):
    model, tokenizer = gemma
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (18, 4, 1)
    assert config.max_position_embeddings == 32768 and model.dtype == torch.float32
    types = layer_types(model)
    assert types.global_layers == [5, 11, 17] and set(types.windows.values()) == {512}
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None


def test_dense_criterion_equals_native_beyond_the_sliding_window_with_left_padding(gemma):
    model, tokenizer = gemma
    ids = passkey_prompt(tokenizer, 700, 0.3, seed=0).input_ids
    pad = 40
    batch = torch.stack([ids[0], torch.cat([torch.full((pad,), tokenizer.pad_token_id), ids[0, pad:]])])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0

    def greedy():
        return model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                              past_key_values=make_cache(model, "static", batch.shape[1] + 5))

    with torch.no_grad():
        native = greedy()
        with apply(model, criterion="dense", moments=None) as run:
            wrapped = greedy()
    assert torch.equal(native.sequences, wrapped.sequences)
    for a, b in zip(native.scores, wrapped.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    summary = run.summary()
    assert summary["sparsity"] == 0.0 and summary["global_layers"] == [5, 11, 17]
    assert summary["sparsity_all_layers"] == pytest.approx(15 / 18)


def test_passkey_beyond_the_window_dense_and_oracle_find_it_qada_decides_on_global_layers(gemma):
    model, tokenizer = gemma
    prompt = passkey_prompt(tokenizer, 1536, 0.3, seed=0)
    assert prompt.needle_position < prompt.length - 512, "the key must lie outside the sliding window"

    def answer(**spec):
        with apply(model, tokenizer=tokenizer, **spec) as run:
            out = model.generate(prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                                 max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, prompt.length:]), run.summary()

    dense, _ = answer(criterion="dense", moments=None)
    oracle, oracle_summary = answer(criterion={"name": "oracle", "tau": 0.6}, moments=None)
    assert str(prompt.key) in dense and str(prompt.key) in oracle
    assert 0.0 < oracle_summary["sparsity"] < 1.0
    _, qada_summary = answer(criterion={"name": "qada", "tau": 0.6}, moments="current")
    per_layer = qada_summary["sparsity_per_layer"]
    assert sorted(per_layer) == [5, 11, 17]
    assert qada_summary["sparsity_all_layers"] == pytest.approx((sum(per_layer.values()) + 15) / 18)


def test_eval_cli_runs_on_gemma(tmp_path):
    from qada.cli import main

    out = tmp_path / "r.json"
    code = main(["eval", "--model", "gemma3-270m", "--task", "niah_single_2", "--length", "1024", "--samples", "1",
                 "--criterion", "oracle", "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["model"]["model_type"] == "gemma3_text"
    assert 0.0 <= record["sparsity"] <= 1.0
    assert record["sparsity_all_layers"] == pytest.approx((3 * record["sparsity"] + 15) / 18, abs=1e-6)
