"""Model cards: a model's attention layout, read from its transformers config, and the ``kv_sparsity`` a given
head sparsity can give on it.

A card needs a config only, never weights, so it works for any family (``AutoConfig.for_model("qwen2", ...)``,
a ``config.json``); :func:`model_card_of` reads the layers of a loaded model from its attention modules instead
(:func:`qada.models.layer_types.layer_types`).

With grouped-query attention the ``H`` query heads of a layer share ``H_kv`` KV heads in groups of
``G = H / H_kv``; a KV head's bulk is skipped only when all ``G`` heads of its group are local
(:mod:`qada.attention.group_policy`). So a head sparsity ``s`` (the fraction of query heads that are local) gives a
``kv_sparsity`` (the fraction of (row, KV head) bulk reads skipped) between two bounds, whatever ``H_kv``:

.. math::

   \\max\\bigl(0,\\ 1 - G\\,(1 - s)\\bigr) \\;\\le\\; \\text{kv\\_sparsity} \\;\\le\\; s,

the lower bound when the dense heads are spread over as many groups as possible, the upper one when the local
heads fill whole groups. Heads that decide independently, each local with probability ``s``, give ``s**G``
in expectation, in between. Sliding-window layers of hybrid models are local already; figures over all layers
count them as 1.0. The measured values come from a run: ``qada eval`` rows carry ``kv_sparsity``.

The math lives in the pure functions :func:`kv_sparsity_best`, :func:`kv_sparsity_independent`,
:func:`kv_sparsity_worst`, :func:`row_kv_sparsity_range` and :func:`over_all_layers`; :class:`ModelCard` calls them.

Example:

    >>> from qada.models.cards import kv_sparsity_best, kv_sparsity_independent, kv_sparsity_worst, over_all_layers
    >>> s, G = 0.9, 3                     # SmolLM2-135M: 9 query heads, 3 KV heads
    >>> [round(f(s, G), 3) for f in (kv_sparsity_worst, kv_sparsity_independent, kv_sparsity_best)]
    [0.7, 0.729, 0.9]
    >>> round(over_all_layers(0.5, num_global=3, num_sliding=15), 3)   # Gemma-3-270M's 18 layers
    0.917
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qada.artifacts import text_config
from qada.functional.checks import group_size as _group_size
from qada.models.layer_types import LayerTypes

__all__ = [
    "HEAD_SPARSITIES",
    "ModelCard",
    "config_layer_types",
    "kv_sparsity_best",
    "kv_sparsity_independent",
    "kv_sparsity_worst",
    "model_card",
    "model_card_of",
    "over_all_layers",
    "row_kv_sparsity_range",
]

#: The head sparsities of a card's table.
HEAD_SPARSITIES = (0.5, 0.7, 0.8, 0.9, 0.95)

_KV_KEYS = ("kv_best", "kv_independent", "kv_worst")


def _check_sparsity(sparsity: float) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"expected a head sparsity in [0, 1] but got {sparsity!r}")
    return float(sparsity)


def _check_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"expected {name} to be an integer >= {minimum} but got {value!r}")
    return value


def kv_sparsity_best(sparsity: float, group_size: int) -> float:
    """Most ``kv_sparsity`` a head sparsity ``s`` can give: ``s``, when the local heads fill whole KV groups.

    A skipped KV head needs its ``G`` query heads local, so at most a fraction ``s`` of the KV heads is skipped;
    that many are when every group is all local or all dense. ``group_size`` (``G``) is checked but does not
    change the bound. For one row with a whole number of local heads see :func:`row_kv_sparsity_range`.
    """
    _check_count("group_size", group_size, 1)
    return _check_sparsity(sparsity)


def kv_sparsity_worst(sparsity: float, group_size: int) -> float:
    """Least ``kv_sparsity`` a head sparsity ``s`` can give: the dense heads spread over as many groups as possible.

    .. math:: \\max\\bigl(0,\\ 1 - G\\,(1 - s)\\bigr) = \\max\\bigl(0,\\ s - (G - 1)(1 - s)\\bigr)

    Every dense head keeps at most one group's bulk read, so at least ``H_kv - (1 - s) H`` of the ``H_kv`` KV
    heads are skipped. Equal to ``s`` when ``G = 1``.
    """
    G = _check_count("group_size", group_size, 1)
    s = _check_sparsity(sparsity)
    return max(0.0, s - (G - 1) * (1.0 - s))


def kv_sparsity_independent(sparsity: float, group_size: int) -> float:
    """Expected ``kv_sparsity`` when every query head is local independently with probability ``s``: ``s**G``.

    Between :func:`kv_sparsity_worst` and :func:`kv_sparsity_best`; equal to ``s`` when ``G = 1``.
    """
    G = _check_count("group_size", group_size, 1)
    return _check_sparsity(sparsity) ** G


def row_kv_sparsity_range(local_heads: int, num_heads: int, num_kv_heads: int) -> tuple[float, float]:
    """``(least, most)`` ``kv_sparsity`` of one row (one layer, one decode step) with ``local_heads`` local heads.

    .. math:: \\Bigl(\\frac{\\max(0,\\ n - (G - 1) H_{kv})}{H_{kv}},\\ \\frac{\\lfloor n / G \\rfloor}{H_{kv}}\\Bigr)

    Most: the ``n`` local heads fill ``floor(n / G)`` whole groups; least: they are spread over the groups as
    evenly as possible, ``G - 1`` per group before any group fills. Averaged over rows, the fractions
    :func:`kv_sparsity_worst` and :func:`kv_sparsity_best` of the mean head sparsity bound these (the first is
    convex, the second the concave envelope of the row maximum).
    """
    H = _check_count("num_heads", num_heads, 1)
    H_kv = _check_count("num_kv_heads", num_kv_heads, 1)
    G = _group_size(H, H_kv)
    n = _check_count("local_heads", local_heads, 0)
    if n > H:
        raise ValueError(f"expected at most num_heads ({H}) local heads but got {n}")
    return max(0, n - (G - 1) * H_kv) / H_kv, (n // G) / H_kv


def over_all_layers(value: float | None, num_global: int, num_sliding: int) -> float:
    """A global-layer fraction ``x`` over all layers, sliding layers counting as 1.0 (local already).

    .. math:: \\frac{n_\\text{global}\\, x + n_\\text{sliding}}{n_\\text{global} + n_\\text{sliding}}

    ``value`` may be ``None`` only when there are no global layers (then the result is 1.0).
    """
    _check_count("num_global", num_global, 0)
    _check_count("num_sliding", num_sliding, 0)
    if num_global + num_sliding == 0:
        raise ValueError("expected at least one layer but got none")
    if num_global == 0:
        return 1.0
    if value is None:
        raise ValueError(f"expected a global-layer value for {num_global} global layers but got None")
    return (num_global * _check_sparsity(value) + num_sliding) / (num_global + num_sliding)


def config_layer_types(config: Any) -> LayerTypes:
    """The global and sliding layers a transformers config declares.

    Its ``layer_types`` list (``"full_attention"`` / ``"sliding_attention"``; Gemma-2/3, Qwen2/3, Cohere-2) where
    it has one, with the window ``sliding_window``; else ``sliding_window`` on every layer (Mistral v0.1) when it
    is set (and ``use_sliding_window`` is not false); else every layer global.
    """
    config = text_config(config)
    num_layers = _check_count("num_hidden_layers", getattr(config, "num_hidden_layers", None), 1)
    window = getattr(config, "sliding_window", None)
    window = window if isinstance(window, int) and not isinstance(window, bool) else None
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None)
    if types is None:
        return LayerTypes(num_layers, {layer: window for layer in range(num_layers)} if window else {})
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(f"expected {num_layers} entries in layer_types but got {len(types)}")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"expected layer_types of 'full_attention' or 'sliding_attention' but got {unknown}")
    sliding = [layer for layer, kind in enumerate(types) if kind == "sliding_attention"]
    if sliding and window is None:
        raise ValueError(f"layers {sliding} are sliding_attention but the config has no sliding_window")
    return LayerTypes(num_layers, {layer: window for layer in sliding})


def _rope_thetas(config: Any) -> tuple[float | None, float | None]:
    """``(global, sliding)`` RoPE base frequencies: per layer type in ``rope_parameters`` or one for all."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        theta = params["full_attention"].get("rope_theta")
        sliding = params.get("sliding_attention", {}).get("rope_theta", theta)
        return theta, sliding
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"], params["rope_theta"]
    theta = getattr(config, "rope_theta", None)
    return theta, getattr(config, "rope_local_base_freq", theta)


@dataclass(frozen=True)
class ModelCard:
    """What qada works with in a model: its global layers, heads, KV groups and positions.

    Attributes:
        name: a label (an embedded model's name, a path, the config's ``_name_or_path``).
        model_type: the config's ``model_type`` (the family: ``llama``, ``qwen2``, ``gemma3_text``, ...).
        layers: the global and sliding-window layers.
        num_heads: query heads per layer ``H``.
        num_kv_heads: KV heads per layer ``H_kv``.
        head_dim: ``d``.
        max_positions: ``max_position_embeddings``.
        rope_theta: RoPE base frequency of the global layers (``None`` if the config has none).
        rope_theta_sliding: that of the sliding layers.
    """

    name: str
    model_type: str
    layers: LayerTypes
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int | None
    rope_theta: float | None = None
    rope_theta_sliding: float | None = None

    def __post_init__(self) -> None:
        _check_count("num_heads", self.num_heads, 1)
        _check_count("num_kv_heads", self.num_kv_heads, 1)
        _check_count("head_dim", self.head_dim, 1)
        _group_size(self.num_heads, self.num_kv_heads)

    @property
    def group_size(self) -> int:
        """``G = H / H_kv``: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def global_layers(self) -> list[int]:
        return self.layers.global_layers

    @property
    def sliding_layers(self) -> list[int]:
        return self.layers.sliding

    @property
    def windows(self) -> list[int]:
        """The distinct sliding windows, ascending (empty when no layer slides)."""
        return sorted(set(self.layers.windows.values()))

    def kv_sparsity(self, sparsity: float) -> dict[str, float | None]:
        """The figures of a head sparsity ``s`` on the global layers: ``sparsity`` (``s``), ``kv_best``,
        ``kv_independent``, ``kv_worst`` (``None`` without global layers), and each over all layers,
        ``..._all_layers`` (sliding layers count as 1.0)."""
        G, n_global, n_sliding = self.group_size, len(self.global_layers), len(self.sliding_layers)
        values: dict[str, float | None] = {
            "sparsity": _check_sparsity(sparsity),
            "kv_best": kv_sparsity_best(sparsity, G),
            "kv_independent": kv_sparsity_independent(sparsity, G),
            "kv_worst": kv_sparsity_worst(sparsity, G),
        }
        if not n_global:  # nothing for qada to decide: the global figures do not exist
            values.update(dict.fromkeys(_KV_KEYS))
        values.update({f"{key}_all_layers": over_all_layers(value, n_global, n_sliding)
                       for key, value in list(values.items())})
        return values

    def table(self, sparsities: tuple[float, ...] = HEAD_SPARSITIES) -> list[dict[str, float | None]]:
        """:meth:`kv_sparsity` for each head sparsity."""
        return [self.kv_sparsity(s) for s in sparsities]

    def describe_layers(self) -> str:
        """One line, e.g. ``"18 layers: 3 global [5, 11, 17], 15 sliding (window 512)"``."""
        if self.layers.num_layers and not self.global_layers:
            windows = ", ".join(map(str, self.windows))
            return f"{self.layers.num_layers} layers, all sliding (window {windows}): none for qada to decide on"
        return self.layers.describe()

    def describe_heads(self) -> str:
        """One line, e.g. ``"9 query heads, 3 KV heads (group size 3), head_dim 64"``."""
        kv = f"{self.num_kv_heads} KV head" + ("s" if self.num_kv_heads > 1 else "")
        return f"{self.num_heads} query heads, {kv} (group size {self.group_size}), head_dim {self.head_dim}"

    def to_dict(self, sparsities: tuple[float, ...] = HEAD_SPARSITIES) -> dict[str, Any]:
        """A JSON-ready dict: the fields, the layer lists and :meth:`table`."""
        return {
            "name": self.name, "model_type": self.model_type, "num_layers": self.layers.num_layers,
            "global_layers": self.global_layers, "sliding_layers": self.sliding_layers,
            "sliding_windows": {str(layer): window for layer, window in sorted(self.layers.windows.items())},
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "group_size": self.group_size,
            "head_dim": self.head_dim, "max_positions": self.max_positions, "rope_theta": self.rope_theta,
            "rope_theta_sliding": self.rope_theta_sliding if self.sliding_layers else None,
            "kv_sparsity": self.table(sparsities),
        }


def model_card(config: Any, name: str | None = None, layers: LayerTypes | None = None) -> ModelCard:
    """The :class:`ModelCard` of a transformers config (a multimodal config's text config is used).

    Args:
        config: a ``PretrainedConfig`` (or any object with its attributes).
        name: the card's label (default: the config's ``_name_or_path``, else its ``model_type``).
        layers: the layer layout, if known otherwise (default: :func:`config_layer_types`).
    """
    text = text_config(config)
    num_heads = _check_count("num_attention_heads", getattr(text, "num_attention_heads", None), 1)
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // num_heads
    theta, theta_sliding = _rope_thetas(text)
    model_type = str(getattr(text, "model_type", "") or "unknown")
    return ModelCard(
        name=name or getattr(config, "_name_or_path", "") or model_type,
        model_type=model_type,
        layers=layers if layers is not None else config_layer_types(text),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_positions=getattr(text, "max_position_embeddings", None),
        rope_theta=None if theta is None else float(theta),
        rope_theta_sliding=None if theta_sliding is None else float(theta_sliding),
    )


def model_card_of(model: Any, name: str | None = None) -> ModelCard:
    """The :class:`ModelCard` of a loaded model: its layers read from its attention modules
    (:func:`~qada.models.layer_types.layer_types`), the rest from ``model.config``."""
    from qada.models.layer_types import layer_types

    return model_card(model.config, name=name, layers=layer_types(model))
