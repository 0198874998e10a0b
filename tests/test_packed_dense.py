"""The ``dense packed`` anchor (:mod:`benchmarks.packed_dense`): transformers' SDPA attention without its copy of
a grouped-query model's K/V, equal to transformers' own function, eagerly and compiled."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.packed_dense import PACKED_ATTENTION, packed_attention, packed_sdpa_forward


def _reference(module, query, key, value, mask, scaling):
    """transformers' own SDPA function (it repeats the K/V of each group where it attends with a mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling)[0]


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), kv=st.integers(1, 3), groups=st.integers(1, 4), S=st.integers(1, 40),
       mask=st.sampled_from(["none", "bool", "bool per head", "additive"]), seed=st.integers(0, 2**16))
def test_packed_decode_attention_equals_transformers(b, kv, groups, S, mask, seed):
    """One query against ``S`` keys, any batch, KV heads and group size, with no mask, a boolean mask shared by the
    heads or one per head (a row's first slots unfilled: never all of them), or an additive one: the output of
    transformers' SDPA function, in its layout ``[b, 1, H, d]``."""
    g = torch.Generator().manual_seed(seed)
    H, d = kv * groups, 8
    query = torch.randn(b, H, 1, d, generator=g)
    key, value = torch.randn(b, kv, S, d, generator=g), torch.randn(b, kv, S, d, generator=g)
    keep = torch.rand(b, 1 if mask != "bool per head" else H, 1, S, generator=g) > 0.3
    keep[..., -1] = True  # every row attends somewhere
    attention_mask = {"none": None, "bool": keep, "bool per head": keep,
                      "additive": torch.where(keep, 0.0, torch.finfo(torch.float32).min)}[mask]  # fmt: skip
    module = _Module(groups)
    out, weights = packed_sdpa_forward(module, query, key, value, attention_mask, scaling=0.3)
    assert weights is None and out.shape == (b, 1, H, d)
    torch.testing.assert_close(out, _reference(module, query, key, value, attention_mask, 0.3))


def test_prefill_and_ungrouped_models_go_to_transformers(monkeypatch):
    """Several queries (a prefill), one KV head per query head or a soft cap: transformers' function itself."""
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("theirs", None))
    q1, q3 = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 3, 8)  # one query, three
    kv2, kv4 = torch.randn(1, 2, 5, 8), torch.randn(1, 4, 5, 8)  # two KV heads (groups of 2), four
    assert packed_sdpa_forward(_Module(2), q3, kv2, kv2, None)[0] == "theirs"
    assert packed_sdpa_forward(_Module(1), q1, kv4, kv4, None)[0] == "theirs"
    assert packed_sdpa_forward(_Module(2), q1, kv2, kv2, None, softcap=30.0)[0] == "theirs"
    assert len(calls) == 3 and calls[2]["softcap"] == 30.0  # passed on, for transformers to refuse
    assert isinstance(packed_sdpa_forward(_Module(2), q1, kv2, kv2, None)[0], torch.Tensor)


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import tiny_model

    return tiny_model("llama")


def _decode(model, forward, steps=4):
    """Prefill 40 tokens into a static cache, then ``steps`` greedy decode steps through ``forward``: the logits."""
    from transformers import StaticCache

    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    cache = StaticCache(config=model.config, max_cache_len=64)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        token, logits = out.logits[:, -1:].argmax(-1), []
        for position in range(40, 40 + steps):
            step = forward(input_ids=token, past_key_values=cache, use_cache=True,
                           cache_position=torch.tensor([position]))  # fmt: skip
            logits.append(step.logits[:, -1])
            token = step.logits[:, -1:].argmax(-1)
    return torch.stack(logits)


def test_packed_model_decodes_as_transformers_eager_and_compiled(tiny):
    """The tiny Llama (GQA, two rows) decodes the same logits with its own attention and packed, eagerly and
    through ``torch.compile(fullgraph=True)``; the block restores the model's implementation."""
    before = tiny.config._attn_implementation
    theirs = _decode(tiny, tiny)
    with packed_attention(tiny):
        assert tiny.config._attn_implementation == PACKED_ATTENTION
        eager = _decode(tiny, tiny)
        torch._dynamo.reset()
        compiled = _decode(tiny, torch.compile(tiny.forward, fullgraph=True))
    assert tiny.config._attn_implementation == before
    torch.testing.assert_close(eager, theirs)
    torch.testing.assert_close(compiled, theirs, rtol=1e-4, atol=1e-4)
