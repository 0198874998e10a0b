"""The models and prefilled contexts of the end-to-end benchmark, and the configurations compared on them."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.end_to_end import dense_run, group_static_mask, qada_run, static_run
from benchmarks.suites import Suite

__all__ = ["build_configs", "build_contexts", "build_model"]


def build_model(suite: Suite, max_length: int) -> tuple[Any, Any, str]:
    """``(model, tokenizer or None, description)``."""
    import transformers

    if suite.model == "smollm2":
        from qada.models import load_default_model

        model, tokenizer = load_default_model(dtype=suite.dtype, device=suite.device)
        return model, tokenizer, "SmolLM2-135M-Instruct (embedded, real weights, dequantised Q4_1 -> float32)"
    if suite.model == "llama3-8b-random":
        size = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=128256)  # fmt: skip
        what = "Llama-3-8B-shaped LlamaForCausalLM with RANDOM weights (timing only; outputs are meaningless)"
    else:
        size = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=1024, vocab_size=1000)  # fmt: skip
        what = "tiny random LlamaForCausalLM (smoke/dry run: 2 layers, 8 heads, 2 KV heads, d=64)"
    config = transformers.LlamaConfig(
        **size, max_position_embeddings=max(2 * max_length, 4096), rope_theta=500000.0, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(suite.dtype)
    try:
        with torch.device(suite.device):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    return model, None, what


def build_contexts(suite: Suite, model: Any, tokenizer: Any) -> dict[int, Any]:
    """``T -> () -> (per-layer [(K, V)], first token)``: a real prefill (SmolLM2 up to ``suite.e2e_real_up_to``
    tokens) or random K/V (random models, and SmolLM2's long "timing only" case: no accuracy from it)."""
    from qada.eval.decode import prefill

    def real(T: int):
        from qada.eval.passkey import passkey_prompt

        def make():
            prompt = passkey_prompt(tokenizer, length=T, depth=0.5)
            done = prefill(model, prompt.input_ids.to(suite.device))
            base = [(layer.keys, layer.values) for layer in done.cache.layers]
            return base, int(done.last_logits.argmax(-1))

        return make

    def random(T: int):
        def make():
            c = model.config
            d = c.hidden_size // c.num_attention_heads
            g = torch.Generator(device=suite.device).manual_seed(T)
            shape = (1, c.num_key_value_heads, T, d)
            base = [
                tuple(torch.randn(shape, generator=g, device=suite.device, dtype=suite.dtype) for _ in range(2))
                for _ in range(c.num_hidden_layers)
            ]
            return base, 1

        return make

    real_up_to = suite.e2e_real_up_to if tokenizer is not None else 0
    return {T: (real(T) if T <= real_up_to else random(T)) for T in suite.e2e_lengths}


def build_configs(suite: Suite, model: Any, tokenizer: Any) -> dict[str, tuple[str, Any]]:
    """name -> (cache kind, run factory), all on the suite's cache unless named otherwise.

    ``dense`` (the unwrapped model, the reference), ``qada dense`` (the wrapper with the ``dense`` criterion: its
    own cost), ``qada`` (tau 0.6, the suite's moments and executor), ``static rho_kv=...``, and the unwrapped
    model on the other cache kind (what a user who changes nothing gets).
    """
    c = model.config
    kind = suite.e2e_cache
    other = "dynamic" if kind == "static" else "static"
    configs: dict[str, tuple[str, Any]] = {"dense": (kind, lambda: None)}
    configs[f"dense {other} cache"] = (other, lambda: None)
    configs["qada dense"] = (kind, lambda: dense_run(suite.e2e_executor))
    configs["qada"] = (kind, lambda: qada_run(model, tokenizer, suite.e2e_moments, suite.e2e_executor))
    for rho in suite.static_rho_kv:
        mask = group_static_mask(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, rho)
        configs[f"static rho_kv={rho}"] = (kind, lambda mask=mask: static_run(mask, suite.e2e_executor))
    return configs
