"""Tiny random decoder models built from configs (no downloads): Llama, Qwen2, Mistral, Gemma-3, all with GQA.

By default Llama, Qwen2 and Mistral use full attention in every layer (2 layers, 4 heads, 2 KV heads, d=16).
Gemma-3 is hybrid: 6 layers, two sliding-window layers then one global, window :data:`TINY_WINDOW`.
``window=W`` gives the sliding / hybrid layouts of the others (see :func:`tiny_config`).
"""

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

FAMILIES = ("llama", "qwen2", "mistral", "gemma3")
TINY_WINDOW = 8  # Gemma-3's default sliding window here


def gemma3_layer_types(num_layers: int) -> list[str]:
    """Two sliding layers, then one global, repeated: layers 2, 5, 8, ... are global."""
    return ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]


def _classes(arch: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"use_sliding_window": False}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
        # query_pre_attn_scalar = head_dim: the usual 1/sqrt(d) scaling (Gemma's default 256 is for d=256)
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                   {"num_hidden_layers": 6, "head_dim": 16, "query_pre_attn_scalar": 16,
                    "sliding_window": TINY_WINDOW}),
    }[arch]


def _window_overrides(arch: str, window: int, num_layers: int) -> dict:
    """Config entries that give ``arch`` sliding-window layers of ``window`` tokens."""
    if arch == "qwen2":  # layers >= max_window_layers slide: the second half by default
        return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": num_layers // 2}
    if arch in ("mistral", "gemma3"):  # Mistral: every layer slides; Gemma-3: its sliding layers
        return {"sliding_window": window}
    raise ValueError(f"{arch} has no sliding-window layers")


def tiny_config(arch: str = "llama", window: int | None = None, **overrides):
    """The config of :func:`tiny_model`.

    Args:
        window: a sliding window of ``window`` tokens: Qwen2 becomes hybrid (layers from ``max_window_layers``,
            by default half the layers, slide; the first half is global), every Mistral layer slides, Gemma-3's
            sliding layers get this window. ``None``: the defaults (full attention; Gemma-3 hybrid with
            :data:`TINY_WINDOW`).
        overrides: config entries (they win over ``window``'s).
    """
    config_cls, _, extra = _classes(arch)
    values = {**COMMON, **extra}
    num_layers = overrides.get("num_hidden_layers", values["num_hidden_layers"])
    if window is not None:
        values.update(_window_overrides(arch, window, num_layers))
    if arch == "gemma3" and "layer_types" not in overrides:
        values["layer_types"] = gemma3_layer_types(num_layers)
    return config_cls(**{**values, **overrides})


def tiny_model(arch: str = "llama", seed: int = 0, sharpen: bool = True, window: int | None = None, **overrides):
    """A random ``*ForCausalLM`` in float32 eval mode; ``sharpen`` scales q/k weights so heads differ.

    ``window`` and ``overrides`` as for :func:`tiny_config`. Gemma-3 normalises queries and keys (``q_norm``,
    ``k_norm``), so there ``sharpen`` scales those norms instead of the projections.
    """
    _, model_cls, _ = _classes(arch)
    torch.manual_seed(seed)
    model = model_cls(tiny_config(arch, window, **overrides)).eval()
    model.generation_config.eos_token_id = None  # random models: always decode the requested number of tokens
    if sharpen:  # sharper attention than a fresh init, so that local and dense heads differ
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    parameter.mul_(4.0)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):  # Gemma: scale (1 + w) from 1 to 2
                    parameter.add_(1.0)
    return model


def saved_tiny_model(directory) -> str:
    """A tiny Llama with the embedded model's tokenizer (and its vocabulary), saved to ``directory`` for the
    command line's ``--model DIR``; returns the directory as a string."""
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory

    tokenizer = AutoTokenizer.from_pretrained(model_directory(None))
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def greedy_step_logits(model, ids: torch.Tensor, cache, steps: int) -> torch.Tensor:
    """Prefill ``ids [1, T]`` into ``cache``, then decode ``steps`` greedy tokens one call each (with their
    ``cache_position``): the last-position logits of every decode call, ``[steps, vocab]``."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits, position = [], ids.shape[1]
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=torch.tensor([position]))
        position += 1
        logits.append(out.logits[:, -1])
    return torch.cat(logits)

