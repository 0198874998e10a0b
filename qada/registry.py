"""Registries of named components (criteria, moment sources, executors) and their dict/YAML configs.

A component is a dataclass whose fields are its configuration. ``registry.register("name")`` adds a class;
``registry.build("name", **params)``, ``registry.build({"name": ..., **params})`` or
``registry.build(instance)`` returns an instance, and ``instance.to_config()`` gives back a dict that builds an
equal component. Unknown names and parameters raise errors that list what is valid.

Components can also come from outside the tree. An installed distribution declares an entry point in the
registry's group (``qada.criteria``, ``qada.executors``, ``qada.moment_sources``), e.g. in its
``pyproject.toml``::

    [project.entry-points."qada.criteria"]
    topk = "qada_topk"            # a module whose import registers with @register_criterion
    # or: topk = "qada_topk:TopK"  # a class, registered under the entry point's name

Entry points are discovered once per process, on the first lookup (``names``, ``get``, ``in``,
``parameters``, ``build``), never at import. A module that is not installed can be imported by name instead:
:func:`import_modules`, the ``imports:`` key of a config (:func:`load_config`) or ``qada --import MODULE``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import os
import types
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch
import yaml

__all__ = ["Component", "PluginError", "Registry", "import_modules", "is_built_in", "load_config"]


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


def is_built_in(part: Any) -> bool:
    """Whether ``part`` is an instance of a class qada defines (not a user's or a plugin's): the compiled routes that
    stand in for ``torch.compile``'s guards (a step traced into the model's graph, the step compiled ahead of time)
    take only these, whose code they know keeps to the rules."""
    return type(part).__module__.startswith("qada.")


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

#: Entry point group per registry kind; other kinds get ``qada.<kind>s`` (spaces as underscores).
ENTRY_POINT_GROUPS = {
    "criterion": "qada.criteria",
    "executor": "qada.executors",
    "moment source": "qada.moment_sources",
}


class PluginError(RuntimeError):
    """An entry point of an installed plugin could not be loaded or registered."""


def _distribution_name(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return str(name) if name else "an unknown distribution"


class Registry(Generic[C]):
    """Named component classes of one kind (e.g. ``"criterion"``).

    Args:
        kind: what the components are, for messages (``"criterion"``).
        base: the class every component must subclass.
        entry_point_group: the entry point group searched for plugins (default: ``qada.criteria``,
            ``qada.executors`` or ``qada.moment_sources`` for those kinds, ``qada.<kind>s`` otherwise).
    """

    def __init__(self, kind: str, base: type[C], entry_point_group: str | None = None) -> None:
        self.kind = kind
        self.base = base
        self.entry_point_group = entry_point_group or ENTRY_POINT_GROUPS.get(
            kind, f"qada.{kind.replace(' ', '_')}s"
        )
        self._classes: dict[str, type[C]] = {}
        self._discovered = False

    def discover(self) -> None:
        """Load the plugins of :attr:`entry_point_group` (once per process; later calls do nothing).

        An entry point names a module (importing it registers its components) or a component class (registered
        under the entry point's name unless it registered itself). A plugin that fails raises
        :class:`PluginError` naming the entry point and its distribution; discovery then runs again on the
        next lookup.
        """
        if self._discovered:
            return
        self._discovered = True  # set first: a plugin that looks up this registry while loading must not recurse
        try:
            for entry_point in importlib.metadata.entry_points(group=self.entry_point_group):
                self._load_entry_point(entry_point)
        except BaseException:
            self._discovered = False
            raise

    def _load_entry_point(self, entry_point: importlib.metadata.EntryPoint) -> None:
        where = (f"entry point {entry_point.name} = {entry_point.value!r} (group {self.entry_point_group!r}) of "
                 f"{_distribution_name(entry_point)}")
        try:
            loaded = entry_point.load()
        except Exception as error:
            raise PluginError(
                f"could not load the {self.kind} plugin {where}: {type(error).__name__}: {error}"
            ) from error
        if isinstance(loaded, type):
            if not issubclass(loaded, self.base):
                raise PluginError(f"{where} gave {loaded!r}, which is not a subclass of {self.base.__name__}")
            if loaded in self._classes.values():
                return
            try:
                self.register(entry_point.name)(loaded)
            except (TypeError, ValueError) as error:
                raise PluginError(f"could not register the {self.kind} plugin {where}: {error}") from error
        elif not isinstance(loaded, types.ModuleType):
            raise PluginError(
                f"{where} gave a {type(loaded).__name__}; expected a module or a subclass of {self.base.__name__}"
            )

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
        self.discover()
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        self.discover()
        return name in self._classes

    def get(self, name: str) -> type[C]:
        self.discover()
        if not isinstance(name, str):
            raise ValueError(f"expected a {self.kind} name (a string) but got {type(name).__name__} {name!r}")
        try:
            return self._classes[name]
        except KeyError:
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.kind} {name!r}; expected one of {self.names()}{hint}") from None

    def parameters(self, name: str) -> list[tuple[str, str, Any]]:
        """``(parameter, type, default)`` for every init field of the component (default ``...`` if required)."""
        cls = self.get(name)  # discovers
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
        self.discover()
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


def import_modules(names: Iterable[str]) -> None:
    """Import each module in ``names`` (their imports register components: ``--import`` and ``imports:``)."""
    if isinstance(names, str):
        names = [names]
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"expected a module name to import but got {name!r}")
        try:
            importlib.import_module(name.strip())
        except ImportError as error:
            raise ValueError(f"could not import module {name!r} given by --import/imports: {error}") from error


def load_config(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A config dict from a mapping, a YAML (or JSON) file path, or a YAML string.

    An optional top-level ``imports:`` key (a module name or a list of them) is processed here: the modules are
    imported (see :func:`import_modules`) and the config comes back without that key.
    """
    if isinstance(source, Mapping):
        loaded: Any = source
    else:
        if not isinstance(source, (str, os.PathLike)):
            raise ValueError(f"expected a config mapping, YAML string or file path but got {type(source).__name__}")
        path = Path(source)
        is_file = path.suffix in {".yaml", ".yml", ".json"} or isinstance(source, os.PathLike)
        looks_like_path = is_file or ("\n" not in str(source) and os.sep in str(source))
        if looks_like_path and path.is_dir():
            raise ValueError(f"expected a config file but {str(source)!r} is a directory")
        try:
            loaded = yaml.safe_load(path.read_text() if is_file else str(source))
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            problem = getattr(error, "problem", None) or type(error).__name__
            what = f"file {str(source)!r}" if is_file else "string"
            raise ValueError(f"could not parse the YAML config {what}{at}: {problem}") from None
    if not isinstance(loaded, Mapping):
        shown = "an empty document" if loaded is None else f"{type(loaded).__name__} {str(loaded)[:40]!r}"
        raise ValueError(f"expected a YAML mapping (name: value lines) for the config but got {shown}")
    config = dict(loaded)
    imports = config.pop("imports", None)
    if imports is not None:
        if isinstance(imports, str):
            imports = [imports]
        if not isinstance(imports, (list, tuple)):
            raise ValueError(f"expected 'imports' to be a module name or a list of them but got {imports!r}")
        import_modules(imports)
    return config
