"""What several subcommands share: the help formatter, ``--import``, the model flags (``--model``, ``--device``,
``--dtype``), argument types, component specs (``--criterion``), ``--config`` files and ``--static`` head masks."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_KEYS",
    "DTYPES",
    "IMPORTS",
    "HelpFormatter",
    "add_model_arguments",
    "add_run_arguments",
    "build_criterion",
    "build_eval_config",
    "component_name",
    "device_spec",
    "existing_file",
    "load_run_config",
    "model_placement",
    "parse_component_spec",
    "positive_int",
    "resolve_device",
    "resolve_dtype",
    "resolve_moments",
    "resolve_spec",
    "spec_label",
    "static_mask_spec",
]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The formatter of every ``qada`` subcommand: each flag's help ends with ``(default: X)``.

    Left out where it says nothing: on-off flags (``store_true``), ``None`` defaults (their help says in words
    what happens without the flag, ``(default: ...)``) and suppressed ones.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.nargs == 0 or "%(default)" in text:
            return text
        return super()._get_help_string(action)


#: The help of every ``--model`` option (the embedded names are those of qada.models.loading.EMBEDDED_MODELS).
MODEL_HELP = ("an embedded model, smollm2-135m or gemma3-270m, a model directory or a .gguf file "
              "(default: smollm2-135m)")

#: The parent parser every subcommand gets: ``--import MODULE`` (repeatable), imported before the command runs.
IMPORTS = argparse.ArgumentParser(add_help=False)
IMPORTS.add_argument(
    "--import", dest="imports", action="append", default=argparse.SUPPRESS, metavar="MODULE",
    help="import MODULE first (e.g. one registering a criterion); repeatable",
)
IMPORTS.add_argument(
    "--no-compile", dest="no_compile", action="store_true", default=argparse.SUPPRESS,
    help="run qada's layer step eagerly instead of compiling it on a static cache (the same function, for "
         "debugging; sets QADA_COMPILE=0)",
)


#: The values of ``--dtype``: ``auto`` (float32 on the CPU, bfloat16 on CUDA) or a torch dtype's name.
DTYPES = ("auto", "float32", "bfloat16", "float16")

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class StoreOnce(argparse.Action):
    """``store``, but a flag given twice is an error (argparse would keep the last one silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"_{self.dest}_given", False):
            hint = f"; {self.help_once}" if getattr(self, "help_once", None) else ""
            parser.error(f"{option_string} given twice (it takes one value){hint}")
        setattr(namespace, f"_{self.dest}_given", True)
        setattr(namespace, self.dest, values)


def one_criterion_action(command: str) -> type[argparse.Action]:
    """:class:`StoreOnce` for ``--criterion`` of ``command``: a second one points to ``qada sweep``."""

    class OneCriterion(StoreOnce):
        help_once = (f"`qada {command}` runs one configuration; to compare several, run it once per criterion or "
                     "use `qada sweep --criterion A --criterion B`")

    return OneCriterion


def device_spec(text: str) -> str:
    """An ``argparse`` type: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Only the form is checked here; whether the device exists is checked by :func:`resolve_device` when the command
    starts, before the model loads.
    """
    value = text.strip().lower()
    if not _DEVICE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N but got {text!r}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--device`` and ``--dtype``: the flags of every subcommand that loads a model.

    The command resolves the last two with :func:`model_placement` before any work and passes them to
    :func:`qada.models.load_model`.
    """
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--device", type=device_spec, default="auto",
                        help="where the model runs: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or "
                             "cuda:N")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="dtype of the model's weights: auto (float32 on cpu, bfloat16 on cuda), float32, "
                             "bfloat16 or float16")


def add_run_arguments(parser: argparse.ArgumentParser, command: str, executor: str = "sdpa") -> None:
    """``--config``, ``--criterion`` or ``--static`` (one of them), ``--tau``, ``--moments`` and ``--executor``: the
    flags of a subcommand that runs one configuration (``command``: its name, for the error on a second
    ``--criterion``; ``executor``: the executor without ``--executor`` or a ``--config`` file's). The command reads
    them with :func:`build_eval_config` (the ``--config`` file first, the flags over it)."""
    parser.add_argument("--config", default=None, metavar="FILE", type=existing_file,
                        help="YAML/JSON file with criterion, moments, executor, window (and imports); flags override "
                             "(default: none)")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--criterion", default=None, action=one_criterion_action(command),
                        help="criterion name (see `qada criteria`), inline YAML/JSON mapping or .yaml/.json file; "
                             "dense = unmodified model (default: the --config file's, else qada)")
    chosen.add_argument("--static", default=None, metavar="FILE", type=existing_file,
                        help="a static head mask written by `qada calibrate` (checked against the model): the "
                             "static criterion with that mask (default: none)")
    parser.add_argument("--tau", type=float, default=None,
                        help="threshold for a criterion given by name (default: the criterion's own, 0.6 for qada)")
    parser.add_argument("--moments", default=None,
                        help="moment source: stored, bucketed, current, a mapping or a file; used if the criterion "
                             "needs moments (default: the --config file's, else stored)")
    parser.add_argument("--executor", default=None,
                        help="attention executor: auto (sdpa on the CPU; on a CUDA GPU triton_fused where the "
                             "kernels decide, else triton), sdpa, reference, flex, triton, triton_fused (qada, "
                             "qada_budget, qada_tail, qada_tail_budget), a mapping or a file (default: the --config "
                             f"file's, else {executor})")


def resolve_device(spec: str) -> Any:
    """The ``torch.device`` of a ``--device`` value (:func:`device_spec`); ``auto`` is ``cuda`` when
    ``torch.cuda.is_available()``, else ``cpu``.

    Raises:
        ValueError: CUDA asked for but not available, or ``cuda:N`` beyond the GPUs there are (a usage error:
            ``qada`` prints one line and exits with status 2).
    """
    import torch

    spec = device_spec(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: CUDA is not available here (torch.cuda.is_available() is False); "
                             "use --device cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {spec}: there is no such GPU; this machine has {count} "
                             f"(cuda:0 to cuda:{count - 1})")
    return device


def resolve_dtype(spec: str, device: Any) -> Any:
    """The ``torch.dtype`` of a ``--dtype`` value on ``device``: ``auto`` is float32 on the CPU, bfloat16 on CUDA."""
    import torch

    if spec not in DTYPES:
        raise ValueError(f"expected --dtype in {', '.join(DTYPES)} but got {spec!r}")
    if spec == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, spec)


def model_placement(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(torch.device, torch.dtype)`` of ``--device`` and ``--dtype`` (:func:`add_model_arguments`).

    Call it first thing in a command that loads a model: a missing GPU is then a one-line usage error before any
    work, not a failure after minutes of it.
    """
    device = resolve_device(args.device)
    return device, resolve_dtype(args.dtype, device)


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (a bad value is a usage error, exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 but got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 but got {value}")
    return value


def existing_file(text: str) -> str:
    """An ``argparse`` type: the path of an existing file (checked when the command line is parsed)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"file {text!r} does not exist" if not Path(text).exists()
                                         else f"expected a file but got the folder {text!r}")
    return text


#: The keys of a ``--config`` file (``imports`` is handled by :func:`qada.registry.load_config`).
CONFIG_KEYS = ("criterion", "moments", "executor", "window")

_SPEC_FILE_SUFFIXES = {".yaml", ".yml", ".json"}
_PLAIN_NAME = re.compile(r"[\w.\-]+")


def parse_component_spec(text: str) -> str | dict[str, Any]:
    """A component spec from the command line: a registered name, an inline YAML/JSON mapping, or a file.

    ``"qada"`` -> ``"qada"``; ``"{name: any_of, criteria: [qada, local]}"`` (or the same in JSON) -> that dict;
    ``"composed.yaml"`` (a ``.yaml``/``.yml``/``.json`` file holding such a mapping) -> the file's mapping.
    """
    import yaml

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a component name, a YAML/JSON mapping or a file but got {text!r}")
    text = text.strip()
    is_file = Path(text).suffix.lower() in _SPEC_FILE_SUFFIXES and "\n" not in text and not text.startswith("{")
    if is_file:
        if not Path(text).is_file():
            raise FileNotFoundError(f"component file {text!r} does not exist")
        source, where = Path(text).read_text(), f"file {text!r}"
    else:
        source, where = text, repr(text)
    try:
        loaded = json.loads(source) if is_file and text.lower().endswith(".json") else yaml.safe_load(source)
    except json.JSONDecodeError as error:
        raise ValueError(f"could not parse the component spec {where}: {error}") from None
    except yaml.YAMLError as error:  # one line: the problem and its place, not PyYAML's drawing of it
        mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None) or error
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"could not parse the component spec {where}{at}: {problem}") from None
    if isinstance(loaded, Mapping):
        config = dict(loaded)
        if "name" not in config:
            raise ValueError(f"expected a mapping with a 'name' key in {where} but got keys {sorted(config)}")
        return config
    if is_file:
        raise ValueError(f"expected a YAML/JSON mapping with a 'name' key in {where} but got {type(loaded).__name__}")
    if isinstance(loaded, str) and _PLAIN_NAME.fullmatch(loaded):
        return loaded
    if _PLAIN_NAME.fullmatch(text):  # a name YAML reads as something else (e.g. "on", "1")
        return text
    raise ValueError(f"expected a component name, a YAML/JSON mapping (with 'name') or a .yaml/.yml/.json file "
                     f"but got {text!r}")


def component_name(spec: Any) -> str:
    """The registry name of a spec (name, mapping or built instance)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        return str(spec.get("name", "?"))
    return getattr(spec, "registry_name", "") or type(spec).__name__


def spec_label(spec: Any, sep: str = " ") -> str:
    """A short label for a spec: ``qada``, ``qada tau=0.3``, or ``any_of#1a2b3c4d`` (a digest) for nested configs.

    ``sep`` goes between the name and flat parameters (``stored:prompt=text,offset=2048`` with ``sep=":"``).
    """
    name = component_name(spec)
    if not isinstance(spec, Mapping):
        return name
    params = {k: v for k, v in spec.items() if k != "name"}
    if not params:
        return name
    if all(isinstance(v, (str, int, float, bool, type(None))) for v in params.values()):
        joiner = " " if sep == " " else ","
        return name + sep + joiner.join(f"{k}={v}" for k, v in params.items())
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{name}#{digest}"


def load_run_config(path: str | None) -> dict[str, Any]:
    """The ``--config`` file as a dict (its ``imports:`` imported); only :data:`CONFIG_KEYS` are accepted."""
    if path is None:
        return {}
    from qada.registry import load_config

    if not Path(path).is_file():
        raise FileNotFoundError(f"config file {path!r} does not exist")
    if Path(path).suffix.lower() not in _SPEC_FILE_SUFFIXES:
        raise ValueError(f"expected a .yaml, .yml or .json config file but got {path!r}")
    config = load_config(path)
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in config file {path!r}; expected some of "
                         f"{[*CONFIG_KEYS, 'imports']}")
    return config


def resolve_spec(flag: str | None, config: Mapping[str, Any], key: str, default: Any) -> Any:
    """The spec for ``key``: the command-line flag if given (parsed), else the config file's, else ``default``."""
    if flag is not None:
        return parse_component_spec(flag)
    return config.get(key, default)


def resolve_moments(flag: str | None, config: Mapping[str, Any], criterion: Any) -> Any:
    """The moment source spec if ``criterion`` declares ``needs_moments`` (default ``stored``), else ``None``."""
    if not criterion.needs_moments:
        return None
    moments = resolve_spec(flag, config, "moments", "stored")
    if moments is None or moments == "none":
        raise ValueError(f"criterion {criterion.registry_name or type(criterion).__name__!r} needs a moment source "
                         f"but the config gives moments: {moments}")
    return moments


def build_criterion(spec: Any, tau: float | None = None) -> tuple[dict[str, Any], Any]:
    """``(config dict, built criterion)`` from a spec; ``tau`` is added to a plain name (``--tau``)."""
    from qada.criteria import CRITERIA

    if tau is not None:
        if not isinstance(spec, str):
            raise ValueError("--tau goes with a criterion name; put tau inside the criterion mapping instead")
        spec = {"name": spec, "tau": tau}
    config = {"name": spec} if isinstance(spec, str) else dict(spec)
    try:
        criterion = CRITERIA.build(config)
    except TypeError as error:  # e.g. a required parameter is missing
        name = config.get("name")
        cls = CRITERIA.get(name) if isinstance(name, str) and name in CRITERIA else None
        if cls is not None and getattr(cls, "needs_calibration", False) is True:
            raise ValueError(f"criterion {name!r} is configured from a calibration (see `qada calibrate`): give its "
                             f"parameters in a mapping ({error})") from None
        raise
    return config, criterion


def build_eval_config(
    spec: Any,
    tau: float | None = None,
    moments: str | None = None,
    executor: str | None = None,
    file_config: Mapping[str, Any] | None = None,
    label: str | None = None,
):
    """One :class:`~qada.eval.configs.EvalConfig` from a criterion spec (``qada eval``, ``qada sweep --criterion``).

    The criterion is built once here to ask what it needs: moments (the ``moments`` flag, else the config file's,
    else ``stored``) go with it only if ``needs_moments``. The family is the criterion's name (with the moment
    source if it needs one: ``qada/stored``), the label the family plus the flat parameters
    (``qada_budget/stored sparsity=0.85``,
    ``qada/stored tau=0.3``; nested specs get a digest: ``any_of#1a2b3c4d``).
    """
    from dataclasses import asdict

    from qada.criteria import DenseCriterion
    from qada.eval.configs import EvalConfig
    from qada.window import Window

    file_config = file_config or {}
    criterion_config, criterion = build_criterion(spec, tau)
    moments_spec = resolve_moments(moments, file_config, criterion)
    executor_spec = resolve_spec(executor, file_config, "executor", "sdpa")
    window = asdict(Window.from_config(file_config.get("window", {"t_local": 128, "t_sink": 16})))
    name = component_name(criterion_config)
    if isinstance(criterion, DenseCriterion):
        family = "dense"  # the evaluator runs the unmodified model
    else:
        family = name if moments_spec is None else f"{name}/{spec_label(moments_spec, sep=':')}"
    label = label or family + spec_label(criterion_config)[len(name):]  # e.g. "qada/stored tau=0.3"
    return EvalConfig(label, criterion_config, moments_spec, executor_spec, window, family=family)


def static_mask_spec(path: str, model: Any = None) -> dict[str, Any]:
    """The criterion spec ``{"name": "static", "mask": [[...]]}`` of a head-mask file (``--static FILE``).

    ``path`` is a head-mask artifact written by ``qada calibrate`` (or :func:`qada.artifacts.save_head_mask`);
    with ``model``, the file must have been made for it (:func:`qada.artifacts.load_head_mask` checks the model
    fingerprint and raises :class:`qada.artifacts.ArtifactError`, a ``ValueError``, otherwise).
    """
    from qada.artifacts import load_head_mask, model_fingerprint

    fingerprint = model_fingerprint(model.config, model) if model is not None else None
    mask, _ = load_head_mask(path, fingerprint)
    return {"name": "static", "mask": mask.tolist()}
