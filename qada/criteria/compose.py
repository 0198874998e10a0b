"""Composition of criteria by wrapping: ``any_of``, ``all_of``, ``not`` and per-layer overrides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qada.criteria.base import CRITERIA, HeadCriterion, register_criterion
from qada.step import DecodeStep

__all__ = ["AllOf", "AnyOf", "LayerOverride", "Not"]


def _build_all(specs: Sequence[Any], what: str) -> list[HeadCriterion]:
    if isinstance(specs, (str, Mapping, HeadCriterion)) or not isinstance(specs, Sequence) or not specs:
        raise ValueError(f"expected a non-empty list of criteria for {what!r} but got {specs!r}")
    return [CRITERIA.build(spec) for spec in specs]


class _Composite(HeadCriterion):
    """Needs whatever any child needs."""

    def children(self) -> list[HeadCriterion]:
        raise NotImplementedError

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
class _Combination(_Composite):
    """A list of child criteria whose decisions are folded with one boolean operator."""

    criteria: list

    def __post_init__(self) -> None:
        self.criteria = _build_all(self.criteria, self.registry_name)

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
class Not(_Composite):
    """Local exactly where the child says dense."""

    criterion: Any

    def __post_init__(self) -> None:
        self.criterion = CRITERIA.build(self.criterion)

    def children(self) -> list[HeadCriterion]:
        return [self.criterion]

    def decide(self, step: DecodeStep) -> torch.Tensor:
        return ~self.criterion(step)


@register_criterion("layer_override")
@dataclass
class LayerOverride(_Composite):
    """``base`` everywhere except the layers named in ``overrides`` (e.g. ``{0: "dense"}``: layer 0 always dense).

    Args:
        base: the criterion for all other layers.
        overrides: layer index -> criterion (instance, name or config).
    """

    base: Any
    overrides: dict

    def __post_init__(self) -> None:
        self.base = CRITERIA.build(self.base)
        if not isinstance(self.overrides, Mapping):
            raise ValueError(f"expected overrides as a mapping layer -> criterion but got {self.overrides!r}")
        built = {}
        for layer, spec in self.overrides.items():
            try:
                index = int(layer)
            except (TypeError, ValueError):
                raise ValueError(f"expected integer layer indices in overrides but got {layer!r}") from None
            if index < 0:
                raise ValueError(f"expected non-negative layer indices in overrides but got {index}")
            built[index] = CRITERIA.build(spec)
        self.overrides = built

    def children(self) -> list[HeadCriterion]:
        return [self.base, *self.overrides.values()]

    def decide(self, step: DecodeStep) -> torch.Tensor:
        return self.overrides.get(step.layer, self.base)(step)
