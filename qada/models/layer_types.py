"""Which attention layers of a model are global (full attention) and which attend over a sliding window.

Hybrid models interleave sliding-window layers with global ones (Gemma-3: five sliding layers per global one;
Qwen2 with ``use_sliding_window``: the layers from ``max_window_layers`` on; Mistral with a ``sliding_window``:
every layer). A sliding layer is already local, so qada passes it through untouched (its own mask, its own
cache) and criteria, moment sources and statistics only see the global layers.

The window of a layer is the cache layout transformers derives from the config, which its masks follow too (the
config's ``layer_types``, or its ``sliding_window`` / ``attention_chunk_size``): a sliding cache of ``W`` slots is a
sliding layer, whatever its attention module holds; chunked attention (Llama-4) passes through the same way. Where
transformers cannot tell, it is read from the attention module: its ``sliding_window`` attribute (``None`` on a
full-attention layer) or ``module.config.sliding_window`` (Mistral, Mixtral).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qada.artifacts import text_config

__all__ = ["GLOBAL_KINDS", "LOCAL_KINDS", "OTHER_KINDS", "LayerTypes", "cache_layers", "cache_windows", "layer_types",
           "module_window"]


def module_window(module: Any) -> int | None:
    """The sliding window of one attention module (``None``: full attention)."""
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) else None


@dataclass(frozen=True)
class LayerTypes:
    """The global and sliding-window layers of a model.

    Attributes:
        num_layers: number of attention layers ``L``.
        windows: ``{layer: window}`` of the sliding-window layers.
    """

    num_layers: int
    windows: dict[int, int]

    @property
    def sliding(self) -> list[int]:
        """Sliding-window layers, ascending."""
        return sorted(self.windows)

    @property
    def global_layers(self) -> list[int]:
        """Full-attention layers (the ones qada decides on), ascending."""
        return [layer for layer in range(self.num_layers) if layer not in self.windows]

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are sliding and some global."""
        return bool(self.windows) and len(self.windows) < self.num_layers

    def is_sliding(self, layer: int) -> bool:
        return layer in self.windows

    def describe(self) -> str:
        """One line, e.g. ``"18 layers: 3 global [5, 11, 17], 15 sliding (window 512)"``."""
        if not self.windows:
            return f"{self.num_layers} layers, all global"
        sizes = sorted(set(self.windows.values()))
        window = ", ".join(str(size) for size in sizes)
        return (f"{self.num_layers} layers: {len(self.global_layers)} global {self.global_layers}, "
                f"{len(self.windows)} sliding (window {window})")


def attention_modules(model: Any) -> list[Any]:
    """The attention modules of ``model`` (those with a ``layer_idx`` whose class name ends in ``Attention``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


GLOBAL_KINDS = ("full_attention",)
LOCAL_KINDS = ("sliding_attention", "chunked_attention", "hybrid_sliding", "reference_sliding_attention")
"""Cache layer kinds of attention layers: global ones (qada decides on them) and local ones (passed through)."""
OTHER_KINDS = ("linear_attention", "conv", "mamba", "hybrid", "dummy", "moe", "mlp", "recurrent")
"""Cache layer kinds without softmax attention over the context (qada never sees them)."""


def cache_layers(config: Any) -> tuple[list[str], list[dict]] | None:
    """The kind of every layer's cache and its arguments, as transformers derives them from ``config``
    (``layer_types``, or the per-layer ``sliding_window`` / ``attention_chunk_size``): the ground truth of what a
    layer's cache holds. ``None`` when transformers cannot tell. Older transformers give one dict of arguments for
    all layers; it is given to each (only the sliding kinds read its ``sliding_window``)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        kinds, kwargs = get_layer_types_and_kwargs(config)
    except Exception:  # noqa: BLE001 - an older transformers, or a config it cannot read: the modules decide
        return None
    if isinstance(kwargs, dict):  # older transformers (5.17 among them): one dict for every layer
        kwargs = [dict(kwargs) for _ in kinds]
    return list(kinds), list(kwargs)


def cache_windows(config: Any) -> dict[int, int]:
    """``{layer: window}`` of the layers whose cache transformers keeps as a sliding window (:func:`cache_layers`),
    for models whose attention modules do not expose their window. Empty when transformers cannot tell."""
    return _windows(cache_layers(config))


def _windows(layers: tuple[list[str], list[dict]] | None) -> dict[int, int]:
    """``{layer: window}`` of :func:`cache_layers`' sliding kinds (empty for ``None``)."""
    if layers is None:
        return {}
    return {layer: int(extra["sliding_window"]) for layer, (kind, extra) in enumerate(zip(*layers, strict=True))
            if isinstance(extra.get("sliding_window"), int) and kind in LOCAL_KINDS}


def layer_types(model: Any) -> LayerTypes:
    """The :class:`LayerTypes` of a transformers model: the cache layout transformers derives from its config (what
    its masks follow), or where transformers cannot tell, the windows its attention modules hold."""
    windows: dict[int, int] = {}
    indices = []
    config = text_config(model.config)
    kinds = cache_layers(config)
    cached = _windows(kinds)
    for module in attention_modules(model):
        layer = module.layer_idx
        if not isinstance(layer, int):
            continue
        indices.append(layer)
        # the cache layout, where transformers knows it, is what the model's mask follows; else the module's window
        window = cached.get(layer) if kinds is not None and layer < len(kinds[0]) else module_window(module)
        if window is not None:
            windows[layer] = window
    num_layers = max(indices) + 1 if indices else int(config.num_hidden_layers)
    return LayerTypes(num_layers, windows)
