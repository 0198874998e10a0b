"""Evaluation configurations (criterion + moments + executor + window) and the paper's sweep grids (§4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qada.models.apply import build_run
from qada.models.run import QAdARun

__all__ = ["EvalConfig", "moment_label", "paper_alphas", "paper_taus", "parse_moment_source", "sweep_configs"]


def parse_moment_source(text: str) -> dict[str, Any]:
    """``"stored:prompt=text,offset=2048"`` -> ``{"name": "stored", "prompt": "text", "offset": 2048}``.

    Values are read as YAML scalars (numbers, booleans, strings); a bare name has no parameters.
    """
    import yaml

    name, _, rest = text.partition(":")
    config: dict[str, Any] = {"name": name.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected key=value in moment source {text!r} but got {item!r}")
        config[key.strip()] = yaml.safe_load(value)
    return config


def moment_label(config: dict[str, Any]) -> str:
    """The inverse of :func:`parse_moment_source`, for labels."""
    params = ",".join(f"{k}={v}" for k, v in config.items() if k != "name")
    return config["name"] + (f":{params}" if params else "")


def paper_taus() -> list[float]:
    """The tau grid for oracle and QAdA: 0.1 .. 0.9 in steps of 0.1, then 0.95, 0.975, 0.99, 0.995."""
    return [round(t, 3) for t in np.arange(0.1, 0.91, 0.1)] + [0.95, 0.975, 0.99, 0.995]


def paper_alphas() -> list[float]:
    """The alpha grid for static masks: 0.05 .. 0.95 in steps of 0.05 (reaches the sparsities QAdA reaches)."""
    return [round(a, 2) for a in np.arange(0.05, 0.951, 0.05)]


@dataclass
class EvalConfig:
    """One configuration of a sweep.

    Attributes:
        label: a short unique name (``"qada/random_words tau=0.6"``).
        criterion: criterion config dict (or name).
        moments: moment source config dict, name, or ``None``.
        executor: executor config dict or name.
        window: ``{"t_local": ..., "t_sink": ...}``.
        family: the curve this point belongs to (``dense``, ``oracle``, ``qada/stored``, ``static``...).
    """

    label: str
    criterion: Any
    moments: Any = None
    executor: Any = "sdpa"
    window: dict = field(default_factory=lambda: {"t_local": 128, "t_sink": 16})
    family: str = ""

    def build(self, observers=()) -> QAdARun:
        return build_run(self.criterion, self.moments, self.executor, self.window, observers)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "family": self.family, "criterion": self.criterion, "moments": self.moments,
                "executor": self.executor, "window": self.window}


def sweep_configs(
    taus: list[float] | None = None,
    moment_sources: tuple[str, ...] = ("stored", "current"),
    include_oracle: bool = True,
    include_dense: bool = True,
    static_masks: dict[str, Any] | None = None,
    alphas: list[float] | None = None,
    executor: Any = "sdpa",
    window: dict | None = None,
) -> list[EvalConfig]:
    """The configurations of a paper-style sweep.

    Args:
        taus: thresholds for oracle and QAdA (default :func:`paper_taus`).
        moment_sources: QAdA moment sources, one curve each (``stored`` uses the random-words reference).
        static_masks: family name -> ``[L, H]`` local frequencies from calibration (``static_oracle``,
            ``static_ruler``), swept over ``alphas``.
    """
    from qada.functional import calibrate_static_mask

    taus = paper_taus() if taus is None else taus
    window = window or {"t_local": 128, "t_sink": 16}
    configs: list[EvalConfig] = []
    if include_dense:
        configs.append(EvalConfig("dense", "dense", None, executor, window, "dense"))
    if include_oracle:
        configs += [EvalConfig(f"oracle tau={t}", {"name": "oracle", "tau": t}, None, executor, window, "oracle")
                    for t in taus]
    for source in moment_sources:
        config = parse_moment_source(source) if isinstance(source, str) else dict(source)
        name = source if isinstance(source, str) else moment_label(config)
        configs += [EvalConfig(f"qada/{name} tau={t}", {"name": "qada", "tau": t}, config, executor, window,
                               f"qada/{name}") for t in taus]
    for family, frequency in (static_masks or {}).items():
        for alpha in paper_alphas() if alphas is None else alphas:
            mask = calibrate_static_mask(frequency, alpha)
            configs.append(EvalConfig(f"{family} alpha={alpha}", {"name": "static", "mask": mask.tolist()}, None,
                                      executor, window, family))
    return configs
