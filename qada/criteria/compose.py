"""Composition of criteria by wrapping: ``any_of``, ``all_of``, ``not`` and per-layer overrides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from qada.criteria.base import CRITERIA, HeadCriterion, register_criterion
from qada.step import DecodeStep
from qada.window import Window

__all__ = ["MAX_DEPTH", "AllOf", "AnyOf", "CompositeCriterion", "LayerOverride", "Not"]

#: The deepest composition accepted (``not`` of ``not`` of ...): deeper configs are refused before Python's
#: recursion limit is reached.
MAX_DEPTH = 64

_building_depth: ContextVar[int] = ContextVar("qada_composition_depth", default=0)


def _depth_error(depth: int) -> ValueError:
    return ValueError(
        f"expected criteria composed (not / any_of / all_of / layer_override) at most {MAX_DEPTH} levels deep "
        f"but got {depth} or more"
    )


def _build(spec: Any) -> HeadCriterion:
    """``CRITERIA.build(spec)`` for a child, refusing configs nested deeper than :data:`MAX_DEPTH`."""
    depth = _building_depth.get() + 1
    if depth >= MAX_DEPTH:
        raise _depth_error(depth + 1)
    token = _building_depth.set(depth)
    try:
        return CRITERIA.build(spec)
    finally:
        _building_depth.reset(token)


def _build_all(specs: Sequence[Any], what: str) -> list[HeadCriterion]:
    if isinstance(specs, (str, Mapping, HeadCriterion)) or not isinstance(specs, Sequence) or not specs:
        raise ValueError(f"expected a non-empty list of criteria for {what!r} but got {specs!r}")
    return [_build(spec) for spec in specs]


def layer_index(layer: Any) -> int:
    """A layer index of ``overrides``: an int >= 0 or a string of digits (JSON keys); floats and bools refused."""
    if isinstance(layer, str) and layer.isascii() and layer.isdigit():
        return int(layer)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"expected integer layer indices in overrides but got {layer!r}")
    if layer < 0:
        raise ValueError(f"expected non-negative layer indices in overrides but got {layer}")
    return layer


class CompositeCriterion(HeadCriterion):
    """Wraps child criteria: needs whatever any child needs, passes every hook on to them (:meth:`children`), and
    refuses a composition deeper than :data:`MAX_DEPTH`."""

    def children(self) -> list[HeadCriterion]:
        raise NotImplementedError

    def _check_depth(self) -> None:
        depth = 1 + max((getattr(child, "composition_depth", 1) for child in self.children()), default=1)
        if depth > MAX_DEPTH:
            raise _depth_error(depth)
        self.composition_depth = depth

    def check_model(self, num_layers: int, num_heads: int) -> None:
        for child in self.children():
            child.check_model(num_layers, num_heads)

    def bind_layers(self, global_layers: Sequence[int]) -> None:
        for child in self.children():
            child.bind_layers(global_layers)

    def to_device(self, device: torch.device) -> None:
        for child in self.children():
            child.to_device(device)

    def observe_prefill(self, layer: int, keys: torch.Tensor, queries: torch.Tensor | None, scale: float | None,
                        start: torch.Tensor | None, window: Window, capacity: int | None = None) -> None:
        for child in self.children():
            child.observe_prefill(layer, keys, queries, scale, start, window, capacity)

    def prompt_queries(self) -> int:
        return max((child.prompt_queries() for child in self.children()), default=0)

    def extra_reads(self, step: DecodeStep) -> torch.Tensor | None:
        """The children's extra reads, summed (each reads what it reads to decide)."""
        total = None
        for child in self.children():
            extra = child.extra_reads(step)
            if extra is not None:
                total = extra if total is None else total + extra
        return total

    @property
    def needs_full_scores(self) -> bool:  # type: ignore[override]
        return any(child.needs_full_scores for child in self.children())

    @property
    def needs_moments(self) -> bool:  # type: ignore[override]
        return any(child.needs_moments for child in self.children())

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return any(child.needs_calibration for child in self.children())


@dataclass
class _Combination(CompositeCriterion):
    """A list of child criteria whose decisions are folded with one boolean operator."""

    criteria: list

    def __post_init__(self) -> None:
        self.criteria = _build_all(self.criteria, self.registry_name)
        self._check_depth()

    def children(self) -> list[HeadCriterion]:
        return self.criteria

    @staticmethod
    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decide(self, step: DecodeStep) -> torch.Tensor:
        local = self.criteria[0](step)
        for child in self.criteria[1:]:
            local = self.combine(local, child(step))
        return local


@register_criterion("any_of")
@dataclass
class AnyOf(_Combination):
    """Local when any child criterion says local."""

    @staticmethod
    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a | b


@register_criterion("all_of")
@dataclass
class AllOf(_Combination):
    """Local only when every child criterion says local."""

    @staticmethod
    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a & b


@register_criterion("not")
@dataclass
class Not(CompositeCriterion):
    """Local exactly where the child says dense."""

    criterion: Any

    def __post_init__(self) -> None:
        self.criterion = _build(self.criterion)
        self._check_depth()

    def children(self) -> list[HeadCriterion]:
        return [self.criterion]

    def decide(self, step: DecodeStep) -> torch.Tensor:
        return ~self.criterion(step)


@register_criterion("layer_override")
@dataclass
class LayerOverride(CompositeCriterion):
    """``base`` everywhere except the layers named in ``overrides`` (e.g. ``{0: "dense"}``: layer 0 always dense).

    Args:
        base: the criterion for all other layers.
        overrides: layer index -> criterion (instance, name or config).
    """

    base: Any
    overrides: dict

    def __post_init__(self) -> None:
        self.base = _build(self.base)
        if not isinstance(self.overrides, Mapping):
            raise ValueError(f"expected overrides as a mapping layer -> criterion but got {self.overrides!r}")
        built = {}
        for layer, spec in self.overrides.items():
            index = layer_index(layer)
            if index in built:
                raise ValueError(f"expected each layer once in overrides but got layer {index} twice")
            built[index] = _build(spec)
        self.overrides = built
        self._check_depth()

    def children(self) -> list[HeadCriterion]:
        return [self.base, *self.overrides.values()]

    def check_model(self, num_layers: int, num_heads: int) -> None:
        beyond = sorted(layer for layer in self.overrides if layer >= num_layers)
        if beyond:
            raise ValueError(f"expected override layers below the model's {num_layers} layers but got {beyond}")
        super().check_model(num_layers, num_heads)

    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """``uses [n]`` bool: which override decides ``layer`` (none: the base), so one step serves every layer."""
        return {"uses": torch.tensor([layer == index for index in self.overrides], dtype=torch.bool)}

    def decide(self, step: DecodeStep) -> torch.Tensor:
        """Every child decides (each keeps its state current); the layer's override, if any, is chosen on the
        device."""
        local = self.base(step)
        if not self.overrides:
            return local
        uses = self.state(step)["uses"]
        for index, child in enumerate(self.overrides.values()):
            local = torch.where(uses[index], child(step), local)
        return local

