"""The fused decode at the head layouts users run decides and decodes as the unfused one: Llama-3-8B's (head dim 128,
four query heads per KV head: the shapes the GPU suite times at 128k), in a tiny Llama of that layout on a 300-token
prompt, and Gemma-3's (head dim 256, four query heads on one KV head), in the embedded Gemma-3-270M itself on a
700-token pass-key prompt (beyond its 512-token sliding window: qada decides on its global layers 5, 11 and 17). Three
decode steps each, every fused launch layout against the ``triton`` executor after the eager criterion. The
hand-picked kernel cases use head dims up to 64 (``tests/test_fused_generated.py`` draws some at 128 and 256); this is
the whole decode step at these dims: moment state, estimate, decision, attention, statistics. On CPU the kernels run
in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from tiny_models import tiny_model  # noqa: E402

from qada.eval.passkey import passkey_prompt  # noqa: E402
from qada.models import load_model  # noqa: E402
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
TOLERANCE = {"llama d128": 1e-5, "gemma-3-270m d256": 1e-4}
"""The logits' absolute and relative tolerance (float32 rounding: the lean case's exact set is merged in another
order; the real model's logits are larger and pass 18 layers)."""


def llama_d128(tmp_path):
    """A tiny Llama of two layers with 8 query heads of 128 on 2 KV heads, a 300-token prompt and a stored reference
    of 420 keys."""
    lm = tiny_model("llama", num_hidden_layers=2, hidden_size=256, head_dim=128, num_attention_heads=8,
                    num_key_value_heads=2).to(DEVICE)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, lm.config.vocab_size, (1, 300), generator=g).to(DEVICE)
    return lm, ids, reference(lm, torch.randint(3, lm.config.vocab_size, (1, 420), generator=g), tmp_path)


def gemma_d256(tmp_path):
    """The embedded Gemma-3-270M (4 query heads of 256 on one KV head, 3 global layers), a 700-token pass-key prompt
    and a stored reference of 760 random tokens' keys."""
    lm, tokenizer = load_model("gemma3-270m")
    lm = lm.to(DEVICE)
    ids = passkey_prompt(tokenizer, 700, 0.3, seed=0).input_ids.to(DEVICE)
    g = torch.Generator().manual_seed(0)
    return lm, ids, reference(lm, torch.randint(3, lm.config.vocab_size, (1, 760), generator=g), tmp_path)


def reference(lm, ids: torch.Tensor, tmp_path) -> str:
    """The path of ``lm``'s keys on ``ids`` [1, n], saved as a stored reference."""
    path = tmp_path / "ref.safetensors"
    collect_reference_keys(lm, ids.to(DEVICE), info={"prompt": "random_words"}).save(path)
    return str(path)


LAYOUTS = {"llama d128": llama_d128, "gemma-3-270m d256": gemma_d256}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory):
    """``(name, model, prompt ids [1, T], stored reference path)`` of one head layout."""
    name = request.param
    return (name, *LAYOUTS[name](tmp_path_factory.mktemp(name.replace(" ", "-"))))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fused_decode_at_users_head_layouts_equals_the_unfused_one(layout, case):
    """Every global layer's decisions at every step and the run's statistics equal; the logits within float32
    rounding; some heads local and some dense."""
    name, lm, ids, ref = layout
    criterion, moments, options = CASES[case]
    fused_logits, fused_decisions, fused_summary = decode(lm, ids, ref, criterion, {**FUSED, **options}, moments)
    logits, decisions, summary = decode(lm, ids, ref, criterion, PLAIN, moments)
    layers = len(summary["global_layers"])
    assert fused_decisions.keys() == decisions.keys() and len(decisions) == layers * len(STEPS)
    for key, local in decisions.items():
        assert torch.equal(fused_decisions[key], local), f"layer {key[0]} at step {key[1]}"
    heads = lm.config.num_attention_heads
    local_heads = sum(int(local.sum()) for local in decisions.values())
    assert 0 < local_heads < heads * len(decisions)  # not vacuous
    assert fused_summary == summary
    torch.testing.assert_close(fused_logits, logits, atol=TOLERANCE[name], rtol=TOLERANCE[name])
