"""The local window: ``T_sink`` attention-sink tokens plus the most recent ``T_local - T_sink`` tokens."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Window"]


@dataclass(frozen=True)
class Window:
    """Sizes of the local index set ``I`` (paper §2; defaults ``T_local = 128``, ``T_sink = 16``).

    ``I = {0 .. T_sink-1} ∪ {T-(T_local-T_sink) .. T-1}`` for a sequence of ``T`` tokens; the bulk is the rest.
    """

    t_local: int = 128
    t_sink: int = 16

    def __post_init__(self) -> None:
        for name in ("t_local", "t_sink"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"expected {name} to be an int but got {type(value).__name__}")
        if self.t_local < 1:
            raise ValueError(f"expected t_local >= 1 but got {self.t_local}")
        if self.t_sink < 0:
            raise ValueError(f"expected t_sink >= 0 but got {self.t_sink}")
        if self.t_sink > self.t_local:
            raise ValueError(f"expected t_sink <= t_local but got t_sink={self.t_sink} > t_local={self.t_local}")

    @classmethod
    def from_config(cls, spec: Window | Mapping[str, Any] | None) -> Window:
        """A window from a :class:`Window`, a mapping ``{t_local: ..., t_sink: ...}`` (missing keys take the
        defaults) or ``None`` (the default window); anything else is a clear error."""
        if spec is None:
            return cls()
        if isinstance(spec, Window):
            return spec
        if not isinstance(spec, Mapping):
            raise ValueError(
                f"expected a window as a mapping {{t_local: ..., t_sink: ...}} or a qada.Window but got "
                f"{type(spec).__name__} {spec!r}"
            )
        valid = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in set(spec) - set(valid))
        if unknown:
            raise ValueError(f"unknown window key(s) {unknown}; expected some of {valid}")
        return cls(**spec)

    @property
    def t_recent(self) -> int:
        """Number of recent tokens in the window, ``T_local - T_sink``."""
        return self.t_local - self.t_sink
