"""The ``model_args`` of lm-eval's ``qada`` model, checked and turned into one qada configuration (issue 24).

Pure parsing, no lm-eval import: lm-eval hands every ``key=value`` of ``--model_args`` over as a string, a number
or (for a literal such as ``{"name": "qada"}``) a Python object; the mappings qada's command line accepts as YAML
(``{name: qada_tail, tau: 0.3}``) arrive as strings and are parsed here. Every problem is a
:class:`QAdaArgumentError` with one line saying which argument and why.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["QADA_ARGS", "QAdaArgumentError", "QAdaArgs", "check_known_args", "parse_qada_args"]

#: The model_args qada reads itself; every other one goes to lm-eval's Hugging Face model (``batch_size``,
#: ``max_length``, ...).
QADA_ARGS = ("pretrained", "criterion", "tau", "moments", "executor", "window", "static", "config", "imports",
             "device", "dtype")


class QAdaArgumentError(ValueError):
    """A bad ``model_args`` entry of the ``qada`` model (printed as one line by ``python -m
    qada.integrations.lm_eval``)."""


@dataclass
class QAdaArgs:
    """The parsed qada part of ``model_args`` (specs not yet built: that needs the model for ``static``)."""

    pretrained: str
    criterion: Any
    tau: float | None
    moments: Any
    executor: Any
    window: dict[str, int] | None
    static: str | None
    config: dict[str, Any]
    imports: list[str]
    device: str
    dtype: str


def _spec(name: str, value: Any) -> Any:
    """A component spec: a name, a mapping, or a YAML/JSON string of one."""
    from qada.cli.common import parse_component_spec

    if value is None or isinstance(value, Mapping):
        return None if value is None else dict(value)
    try:
        return parse_component_spec(str(value))
    except (ValueError, FileNotFoundError) as error:
        raise QAdaArgumentError(f"model_args {name}: {error}") from None


def _window(value: Any) -> dict[str, int] | None:
    import yaml

    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return {"t_local": value}
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise QAdaArgumentError(f"model_args window: could not parse {value!r} (expected an int t_local or a "
                                    "mapping {t_local: 128, t_sink: 16})") from None
        if isinstance(value, int) and not isinstance(value, bool):
            return {"t_local": value}
    if not isinstance(value, Mapping):
        raise QAdaArgumentError(f"model_args window: expected an int t_local or a mapping {{t_local: 128, t_sink: "
                                f"16}} but got {value!r}")
    from qada.window import Window

    try:
        Window.from_config(dict(value))
    except (TypeError, ValueError) as error:
        raise QAdaArgumentError(f"model_args window: {error}") from None
    return dict(value)


def _imports(value: Any) -> list[str]:
    if value is None:
        return []
    names = value if isinstance(value, (list, tuple)) else str(value).replace(";", " ").split()
    return [str(name) for name in names if str(name).strip()]


def check_known_args(args: Mapping[str, Any], others: Collection[str]) -> None:
    """Raise :class:`QAdaArgumentError` for a ``model_args`` key that neither qada (:data:`QADA_ARGS`) nor the model
    the rest goes to (``others``, e.g. the parameters of lm-eval's ``HFLM``) takes: such a key would be dropped
    without a word (``tua=0.1`` for ``tau``)."""
    known = set(QADA_ARGS) | set(others)
    unknown = [key for key in args if key not in known]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise QAdaArgumentError(f"model_args {key}: unknown argument (neither qada's {', '.join(QADA_ARGS)} nor one "
                                f"of lm-eval's Hugging Face model){hint}")


def parse_qada_args(args: Mapping[str, Any], others: Collection[str] | None = None) -> tuple[QAdaArgs, dict[str, Any]]:
    """``(qada's arguments, the rest for lm-eval's HFLM)`` from ``model_args``; imports the plugins and reads the
    ``config`` file first, so that names they register resolve. ``others``: the keys the rest may hold (the
    parameters of the model it goes to; ``None``: not checked). Raises :class:`QAdaArgumentError`."""
    from qada.cli.common import load_run_config
    from qada.registry import import_modules

    if others is not None:
        check_known_args(args, others)
    args = dict(args)
    imports = _imports(args.pop("imports", None))
    try:
        import_modules(imports)
    except ValueError as error:
        raise QAdaArgumentError(f"model_args imports: {error}") from None
    config_path = args.pop("config", None)
    try:
        config = load_run_config(None if config_path is None else str(config_path))
    except (ValueError, FileNotFoundError) as error:
        raise QAdaArgumentError(f"model_args config: {error}") from None
    static = args.pop("static", None)
    if static is not None and not Path(str(static)).is_file():
        raise QAdaArgumentError(f"model_args static: head-mask file {str(static)!r} does not exist")
    criterion = _spec("criterion", args.pop("criterion", None))
    if static is not None and criterion is not None:
        raise QAdaArgumentError("model_args: give either criterion or static (a calibrated head mask), not both")
    tau = args.pop("tau", None)
    if tau is not None:
        try:
            tau = float(tau)
        except (TypeError, ValueError):
            raise QAdaArgumentError(f"model_args tau: expected a number but got {tau!r}") from None
    pretrained = args.pop("pretrained", None)
    parsed = QAdaArgs(
        pretrained="smollm2-135m" if pretrained is None else str(pretrained),
        criterion=criterion,
        tau=tau,
        moments=_spec("moments", args.pop("moments", None)),
        executor=_spec("executor", args.pop("executor", None)),
        window=_window(args.pop("window", None)),
        static=None if static is None else str(static),
        config=config,
        imports=imports,
        device=str(args.pop("device", None) or "cpu"),
        dtype=str(args.pop("dtype", None) or "auto"),
    )
    return parsed, args
