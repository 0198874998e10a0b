"""Tiny random decoder models built from configs (no downloads): Llama, Qwen2, Mistral, all with GQA."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def _classes(arch: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"use_sliding_window": False}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    }[arch]


def tiny_config(arch: str = "llama", **overrides):
    """The config of :func:`tiny_model` (2 layers, 4 heads, 2 KV heads, d=16)."""
    config_cls, _, extra = _classes(arch)
    return config_cls(**{**COMMON, **extra, **overrides})


def tiny_model(arch: str = "llama", seed: int = 0, sharpen: bool = True, **overrides):
    """A random ``*ForCausalLM`` in float32 eval mode; ``sharpen`` scales q/k weights so heads differ."""
    _, model_cls, _ = _classes(arch)
    torch.manual_seed(seed)
    model = model_cls(tiny_config(arch, **overrides)).eval()
    model.generation_config.eos_token_id = None  # random models: always decode the requested number of tokens
    if sharpen:  # sharper attention than a fresh init, so that local and dense heads differ
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    parameter.mul_(4.0)
    return model
