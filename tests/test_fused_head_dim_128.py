"""The fused decode at Llama-3-8B's head layout (head dim 128, four query heads per KV head: the shapes the GPU
suite times at 128k) decides and decodes as the unfused one: a tiny Llama with that layout, a 300-token prompt, three
decode steps, each fused launch layout against the ``triton`` executor after the eager criterion. The hand-picked
kernel cases use head dims up to 64 (``tests/test_fused_generated.py`` draws some at 128); this is the whole decode
step at 128: moment state, estimate, decision, attention, statistics. On CPU the kernels run in Triton's
interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from tiny_models import tiny_model  # noqa: E402

from qada.moments.reference import collect_reference_keys  # noqa: E402
from tests.forced_decode import STEPS, decode  # noqa: E402
from tests.test_attention_triton import DEVICE  # noqa: E402

PLAIN = {"name": "triton", "block_size": 16, "num_splits": 4}
FUSED = {**PLAIN, "name": "triton_fused"}
LEAN = {"name": "qada_tail", "tau": 0.42, "attend_exact": True, "super_page": 4, "super_pages": 2, "pages": 2,
        "heavy": 8, "scale_exact": 8192, "shrink_exact": False}
CASES = {  # name: (criterion, moments, the fused executor's options)
    "qada": ({"name": "qada", "tau": 0.42}, "stored", {}),
    "qada estimating": ({"name": "qada", "tau": 0.42}, "stored", {"estimate_in_splits": True}),  # moments ahead
    "qada estimating current": ({"name": "qada", "tau": 0.42}, "current", {"estimate_in_splits": True}),
    "qada_tail once": ({"name": "qada_tail", "tau": 0.42}, "stored", {"decide_once": True}),
    "qada_tail splits spread": ({"name": "qada_tail", "tau": 0.42}, "current",
                                {"decide_once": False, "pages_per_program": 4}),
    "qada_tail_budget": ({"name": "qada_tail_budget", "sparsity": 0.85}, "stored", {}),
    "lean": (LEAN, "stored", {"decide_once": False}),
}


@pytest.fixture(scope="module")
def llama_layout(tmp_path_factory):
    """A tiny Llama of two layers with 8 query heads of 128 on 2 KV heads, a 300-token prompt and a stored reference
    of 420 keys."""
    lm = tiny_model("llama", num_hidden_layers=2, hidden_size=256, head_dim=128, num_attention_heads=8,
                    num_key_value_heads=2).to(DEVICE)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, lm.config.vocab_size, (1, 300), generator=g).to(DEVICE)
    ref = tmp_path_factory.mktemp("d128") / "ref.safetensors"
    collect_reference_keys(lm, torch.randint(3, lm.config.vocab_size, (1, 420), generator=g).to(DEVICE),
                           info={"prompt": "random_words"}).save(ref)
    return lm, ids, str(ref)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fused_decode_at_head_dim_128_equals_the_unfused_one(llama_layout, case):
    """Every layer's decisions at every step and the run's statistics equal; the logits within float32 rounding
    (the lean case's exact set is merged in another order); some heads local and some dense."""
    lm, ids, ref = llama_layout
    criterion, moments, options = CASES[case]
    fused_logits, fused_decisions, fused_summary = decode(lm, ids, ref, criterion, {**FUSED, **options}, moments)
    logits, decisions, summary = decode(lm, ids, ref, criterion, PLAIN, moments)
    assert fused_decisions.keys() == decisions.keys() and len(decisions) == 2 * len(STEPS)
    for key, local in decisions.items():
        assert torch.equal(fused_decisions[key], local), f"layer {key[0]} at step {key[1]}"
    local_heads = sum(int(local.sum()) for local in decisions.values())
    assert 0 < local_heads < 8 * len(decisions)  # not vacuous
    assert fused_summary == summary
    torch.testing.assert_close(fused_logits, logits, atol=1e-5, rtol=1e-5)
