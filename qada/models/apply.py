"""Installing qada on a transformers model: :func:`apply` (a context manager) and :func:`enable` (persistent)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from qada.artifacts import text_config
from qada.attention import EXECUTORS
from qada.criteria import CRITERIA
from qada.models.attention_features import check_attention_source
from qada.models.attention_function import ATTENTION_NAME, RUN_NUMBER, active_runs, qada_attention_forward
from qada.models.compiled import register_run
from qada.models.inline_step import register_attend_op
from qada.models.layer_types import GLOBAL_KINDS, LOCAL_KINDS, OTHER_KINDS, attention_modules, cache_layers, layer_types
from qada.models.observers import Observer
from qada.models.run import QAdARun, UnsupportedModelError
from qada.moments import MOMENT_SOURCES
from qada.registry import load_config
from qada.window import Window

__all__ = ["apply", "attach", "build_run", "check_run_fits", "enable", "prepare_run", "register_attention",
           "weights_placement"]

_DEFAULTS = {"criterion": "qada", "moments": "stored", "executor": "auto"}


def register_attention() -> None:
    """Register qada's attention function (and the SDPA mask it needs) with transformers, under ``"qada"``.

    Called by :func:`enable`; idempotent. Only qada's own name is added: no transformers function is wrapped.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not qada_attention_forward:
        AttentionInterface.register(ATTENTION_NAME, qada_attention_forward)
    if ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def _check_model(model: Any) -> list[Any]:
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False) or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(
            f"{name} does not route its attention through transformers' AttentionInterface, so qada cannot wrap it"
        )
    modules = attention_modules(model)
    if not modules:
        raise UnsupportedModelError(f"{name} has no attention modules with a layer_idx: qada cannot wrap it")
    check_attention_source(model, modules)
    _check_layer_kinds(model, modules)
    if any(m in active_runs for m in modules):
        raise UnsupportedModelError(f"qada is already enabled on this {name}; remove the first run before a second")
    return modules


def _check_layer_kinds(model: Any, modules: list[Any]) -> None:
    """Refuse layers whose cache qada does not know (compressed attention, ...) and attention modules that serve
    several cache layers each (a recurrent model that runs its layers several times per token)."""
    layers = cache_layers(text_config(model.config))
    if layers is None:
        return
    family = getattr(model.config, "model_type", type(model).__name__)
    unknown = sorted({kind for kind in layers[0] if kind not in GLOBAL_KINDS + LOCAL_KINDS + OTHER_KINDS})
    if unknown:
        raise UnsupportedModelError(
            f"{family}: layers of kind {', '.join(unknown)}, whose cache qada does not know; qada decides on full "
            "attention, passes sliding and chunked attention through and never sees linear attention or state spaces"
        )
    attention = [kind for kind in layers[0] if kind in GLOBAL_KINDS + LOCAL_KINDS]
    if len(attention) > len(modules):
        raise UnsupportedModelError(
            f"{family}: {len(modules)} attention modules fill {len(attention)} cache layers (the model runs its "
            "layers several times per token); qada keeps one decision state per attention module and cannot serve it"
        )


def _components(
    criterion: Any, moments: Any, executor: Any, window: Any, config: str | os.PathLike | Mapping | None
) -> tuple[Any, Any, Any, Window]:
    specs: dict[str, Any] = dict(_DEFAULTS)
    if config is not None:
        loaded = load_config(config)
        unknown = sorted(set(loaded) - {"criterion", "moments", "executor", "window"})
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; expected criterion, moments, executor, window")
        specs.update(loaded)
    for key, value in (("criterion", criterion), ("moments", moments), ("executor", executor), ("window", window)):
        if value is not None:
            specs[key] = value
    built_criterion = CRITERIA.build(specs["criterion"])
    built_moments = None if specs["moments"] in (None, "none") else MOMENT_SOURCES.build(specs["moments"])
    built_executor = EXECUTORS.build(specs["executor"])
    built_window = Window.from_config(specs.get("window"))
    return built_criterion, built_moments, built_executor, built_window


def build_run(
    criterion: Any = None,
    moments: Any = None,
    executor: Any = None,
    window: Window | Mapping | None = None,
    observers: Sequence[Observer] = (),
    config: str | os.PathLike | Mapping | None = None,
    compile: bool | str | None = None,
) -> QAdARun:
    """A :class:`~qada.models.run.QAdARun` from components (objects, names or configs), not yet attached;
    ``compile`` as for :func:`enable`."""
    built_criterion, built_moments, built_executor, built_window = _components(
        criterion, moments, executor, window, config
    )
    if built_criterion.needs_moments and built_moments is None:
        raise ValueError(f"criterion {built_criterion.registry_name!r} needs a moment source but moments is None")
    return QAdARun(built_criterion, built_moments, built_executor, built_window, observers, compile=compile)


def check_run_fits(run: QAdARun, model: Any) -> None:
    """Raise ``ValueError`` before any work if ``run``'s criterion cannot serve ``model`` (e.g. a layer override
    beyond its layers, a static mask of another shape): :meth:`~qada.criteria.HeadCriterion.check_model`."""
    config = text_config(model.config)
    run.layers = layer_types(model)
    run.criterion.check_model(run.layers.num_layers, int(config.num_attention_heads))
    run.criterion.bind_layers(run.layers.global_layers)


def prepare_run(run: QAdARun, model: Any, tokenizer: Any = None) -> QAdARun:
    """Run the moment source's one-off preparation for ``model`` (a stored reference) if the run uses it.

    Checks first that the criterion fits the model (:func:`check_run_fits`)."""
    check_run_fits(run, model)
    if run.uses_moments and run.moments.needs_model:
        run.moments.prepare(model, tokenizer, window=run.window)
    return run


def weights_placement(model: Any) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of ``model``'s floating-point weights (those of the first; the CPU and float32 for a
    model without any). A model whose weights lie on several kinds of device (offloaded to the CPU, on the meta
    device) counts as on the CPU."""
    weights = [p for p in model.parameters() if p.is_floating_point()] if hasattr(model, "parameters") else []
    if not weights:
        return torch.device("cpu"), torch.float32
    if len({p.device.type for p in weights}) > 1:
        return torch.device("cpu"), weights[0].dtype
    return weights[0].device, weights[0].dtype


def attach(model: Any, run: QAdARun) -> QAdARun:
    """Route ``model``'s attention through ``run`` until ``run.remove()``; the run must already be prepared. An
    ``auto`` executor becomes the one it picks for the model's device and dtype
    (:meth:`~qada.models.run.QAdARun.resolve_executor`)."""
    modules = _check_model(model)
    check_run_fits(run, model)
    run.resolve_executor(*weights_placement(model))
    register_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise UnsupportedModelError(f"{type(model).__name__} refused the attention implementation {ATTENTION_NAME!r}")
    if not run.layers.global_layers:
        warnings.warn(
            f"every attention layer of {type(model).__name__} attends over a sliding window "
            f"({run.layers.describe()}): they pass through untouched and qada has no global layer to decide on",
            stacklevel=2,
        )
    register_run(run)  # its number for the compiled decode step (qada.models.compiled)
    register_attend_op()  # the executor's operator of a step traced inline (qada.models.inline_step)
    for module in modules:
        active_runs[module] = run
        setattr(module, RUN_NUMBER, run.op_number)  # what a compiled model's graph is guarded on

    def remove() -> None:
        for module in modules:
            active_runs.pop(module, None)
            module.__dict__.pop(RUN_NUMBER, None)
        model.set_attn_implementation(previous)

    run._remove = remove
    return run


def enable(
    model: Any,
    criterion: Any = None,
    moments: Any = None,
    executor: Any = None,
    window: Window | Mapping | None = None,
    observers: Sequence[Observer] = (),
    tokenizer: Any = None,
    config: str | os.PathLike | Mapping | None = None,
    compile: bool | str | None = None,
) -> QAdARun:
    """Wrap ``model`` until ``run.remove()`` is called; returns the :class:`~qada.models.run.QAdARun`.

    Components are objects, registry names, or config dicts; ``config`` (a dict, YAML string or YAML file) gives
    ``criterion``, ``moments``, ``executor`` and ``window`` at once, and explicit arguments override it.
    Defaults: ``qada`` criterion (tau 0.6), ``stored`` moments (a random-words reference built once per model and
    cached), the ``auto`` executor (``sdpa`` on the CPU; on a CUDA GPU with Triton ``triton_fused`` where the
    kernels make the criterion's decision, else ``triton``: :mod:`qada.attention.auto`), window 128/16. Moments
    are prepared (the reference run) only if the criterion or an observer needs them. ``tokenizer`` is needed to
    build a stored reference prompt.

    ``compile``: how a decode step of a global layer on a preallocated cache (``StaticCache``) runs. ``True`` (the
    default, unless the environment variable ``QADA_COMPILE`` says otherwise): the whole layer step (moment step,
    decision, group policy, statistics, window gather) is compiled once by ``torch.compile`` (inductor,
    ``fullgraph=True``) and reused by every layer and step; ``False``: the very same function, eagerly (for
    debugging); a string: that ``torch.compile`` backend. A growing cache (``DynamicCache``) changes shape every
    step and always runs the step eagerly. A criterion that cannot be compiled runs eagerly, with one warning.
    """
    _check_model(model)
    run = build_run(criterion, moments, executor, window, observers, config, compile=compile)
    return attach(model, prepare_run(run, model, tokenizer))


@contextmanager
def apply(model: Any, *args: Any, **kwargs: Any) -> Iterator[QAdARun]:
    """``with qada.apply(model, criterion=..., moments=..., executor=...) as run:`` — see :func:`enable`.

    The model's previous attention implementation is restored on exit, also after an exception.
    """
    run = enable(model, *args, **kwargs)
    try:
        yield run
    finally:
        run.remove()
