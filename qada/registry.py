"""Registries of named components (criteria, moment sources, executors) and their dict/YAML configs.

A component is a dataclass whose fields are its configuration. ``registry.register("name")`` adds a class;
``registry.build("name", **params)``, ``registry.build({"name": ..., **params})`` or
``registry.build(instance)`` returns an instance, and ``instance.to_config()`` gives back a dict that builds an
equal component. Unknown names and parameters raise errors that list what is valid.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch
import yaml

__all__ = ["Component", "Registry", "load_config"]


class Component:
    """Base of every registered component: config round trip from the dataclass fields.

    Subclasses are ``@dataclass`` classes; a field holding a tensor is written to the config as nested lists,
    a field holding another component as that component's config.
    """

    registry_name: ClassVar[str] = ""

    @classmethod
    def from_config(cls, params: Mapping[str, Any]) -> Component:
        """Build from the parameters of a config (without ``name``)."""
        valid = [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else []
        unknown = sorted(set(params) - set(valid))
        if unknown:
            raise ValueError(
                f"{cls.registry_name or cls.__name__!r} got unknown parameter(s) {unknown}; "
                f"expected some of {valid}"
            )
        return cls(**params)

    def to_config(self) -> dict[str, Any]:
        """A plain dict (YAML/JSON-friendly) with ``name`` and every init field."""
        config: dict[str, Any] = {"name": self.registry_name}
        for field in dataclasses.fields(self):
            if field.init:
                config[field.name] = _to_plain(getattr(self, field.name))
        return config


def _to_plain(value: Any) -> Any:
    if isinstance(value, Component):
        return value.to_config()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


C = TypeVar("C", bound=Component)


class Registry(Generic[C]):
    """Named component classes of one kind (e.g. ``"criterion"``)."""

    def __init__(self, kind: str, base: type[C]) -> None:
        self.kind = kind
        self.base = base
        self._classes: dict[str, type[C]] = {}

    def register(self, name: str, override: bool = False) -> Callable[[type[C]], type[C]]:
        """Class decorator adding a component under ``name``; re-registering a name needs ``override=True``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"expected a non-empty string name for a {self.kind} but got {name!r}")

        def decorator(cls: type[C]) -> type[C]:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"expected a subclass of {self.base.__name__} but got {cls!r}")
            if name in self._classes and self._classes[name] is not cls and not override:
                raise ValueError(
                    f"a {self.kind} named {name!r} is already registered ({self._classes[name].__qualname__}); "
                    f"pass override=True to replace it"
                )
            cls.registry_name = name
            self._classes[name] = cls
            return cls

        return decorator

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def get(self, name: str) -> type[C]:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; expected one of {self.names()}") from None

    def parameters(self, name: str) -> list[tuple[str, str, Any]]:
        """``(parameter, type, default)`` for every init field of the component (default ``...`` if required)."""
        cls = self.get(name)
        rows = []
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                default = ...
            type_name = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
            rows.append((field.name, type_name, default))
        return rows

    def build(self, spec: C | str | Mapping[str, Any], **params: Any) -> C:
        """An instance from an instance (returned as is), a name plus ``params``, or a config dict."""
        if isinstance(spec, self.base):
            if params:
                raise ValueError(f"parameters {sorted(params)} given together with a built {self.kind}")
            return spec
        if isinstance(spec, str):
            return self.get(spec).from_config(params)
        if isinstance(spec, Mapping):
            config = dict(spec)
            if "name" not in config:
                raise ValueError(f"expected a {self.kind} config with a 'name' key but got keys {sorted(config)}")
            name = config.pop("name")
            config.update(params)
            return self.get(name).from_config(config)
        raise TypeError(
            f"expected a {self.kind} instance, name or config dict but got {type(spec).__name__}"
        )


def load_config(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A config dict from a mapping, a YAML file path, or a YAML string."""
    if isinstance(source, Mapping):
        return dict(source)
    text = Path(source).read_text() if Path(str(source)).suffix in {".yaml", ".yml"} else str(source)
    loaded = yaml.safe_load(text)
    if not isinstance(loaded, Mapping):
        raise ValueError(f"expected a YAML mapping but got {type(loaded).__name__}")
    return dict(loaded)
