"""The compiled layer step on the CPU, ahead of time: exported once per configuration at the first cache size,
compiled by AOTInductor, called with no guards.

``torch.compile``'s way into a compiled function (its guards over every input and every component attribute the
trace read, its runtime wrappers, the Python call of the generated code) costs about as much as the layer step's
kernels on a 2-core CPU: a ``qada_tail`` step of SmolLM2 at 7.68k took ~430 us a call through ``torch.compile``
and ~180 us as the same kernels compiled ahead of time (``torch.export`` + AOTInductor), called directly. Per decode
step of 30 layers that is ~7 ms of a ~90 ms step.

:class:`AheadOfTimeStep` makes that call. What ``torch.compile``'s guards checked, it checks in one key per call:

* the inputs' structure (which are ``None``, the state dictionaries' keys) and every tensor's dtype, shape and
  strides, and that all are on the CPU;
* the floats baked into the step (the attention scale, the soft cap);
* the components' configuration: the fields of every component (they are dataclasses: their fields are their
  configuration), so that changing e.g. ``tau`` between steps compiles the step again, as a guard would;
* the torch thread count (the kernels' OpenMP teams are sized when compiled) and the default dtype.

The key in Python costs ~45 us a call (~65 us inside a decode step, its objects out of the cache), a sixth of the
step's kernels. So a call whose key is the last call's takes a fast path: the settings, the structure, the threads,
the dtype and the gradient mode are compared as before, and the tensors' dtype, device, shape, strides and
``requires_grad`` by ``torch.compile``'s own tensor guard in C++ (:func:`tensor_guard`, ~4 us for the 22-28 tensors
of a step). Anything else changed, the full key is made and looked up as before.

A key seen for the first time (at the inputs' first shapes) is exported (``torch.export``, non-strict: the step's own
Python, run once on fake tensors), checked for host reads as :func:`~qada.models.layer_step.compile_layer_step`
checks, and compiled by AOTInductor with the step's options (:func:`~qada.models.step_compile.cpu_step_options`); the
package is kept in
Inductor's cache directory (``qada_aot/``) under a hash of the exported graph's code and the key, so a later process
loads it in milliseconds instead of compiling again (~15-25 s). In-place updates of the inputs (the moment state, the
statistics' sums) are part of the exported graph.

It declines (returns ``None``, and the run takes ``torch.compile``'s route as before) where it cannot stand in for
the guards: a component that is not one of qada's own (a user's may read attributes that are not fields), a tensor
the step would capture as a constant, inputs on another device, gradients wanted, an export that fails, more than
:data:`MAX_ENTRIES` configurations, or another cache size than the first (an evaluation over prompts of many
lengths decodes a few tokens per size, which would not pay for a compilation each: ``torch.compile``'s dynamic shapes
serve those with one).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import os
import tempfile
import threading
import warnings
from typing import Any, NamedTuple

import torch

from qada.models.inline_step import flatten_result, unflatten_result
from qada.models.step_compile import HostReadError, cpu_step_options, unbacked_node
from qada.registry import is_built_in

__all__ = ["AOT_DIRECTORY", "MAX_ENTRIES", "AheadOfTimeStep", "StepKey", "flatten_arguments", "settings",
           "tensor_guard"]

MAX_ENTRIES = 2
"""Configurations (e.g. two values of ``tau``) one step compiles ahead of time, all at the inputs' first shapes; a
later one, or another cache size, goes to ``torch.compile``."""

AOT_DIRECTORY = "qada_aot"
"""The folder of compiled packages inside Inductor's cache directory."""


def flatten_arguments(args: tuple) -> tuple[list[torch.Tensor], tuple]:
    """The tensors of a layer step's arguments in ``torch.export``'s order (dictionaries by insertion order, ``None``
    left out) and the rest of their structure: ``(leaves, structure)``; ``structure`` names each argument's kind
    (a tensor, ``None``, a float, a dictionary's keys)."""
    leaves: list[torch.Tensor] = []
    structure: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            leaves.append(arg)
            structure.append(True)
        elif isinstance(arg, dict):
            names = []
            for name, value in arg.items():
                if isinstance(value, dict):
                    leaves.extend(value.values())
                    names.append((name, tuple(value)))
                else:
                    leaves.append(value)
                    names.append(name)
            structure.append(tuple(names))
        else:  # None, or a float baked into the step
            structure.append(arg)
    return leaves, tuple(structure)


def _in_fresh_thread(function: Any, *args: Any) -> Any:
    """``function(*args)`` in a new thread, whose dispatcher state is fresh: the step may be compiled from inside an
    operator of a compiled model (``qada::decode_buffer``), whose thread-local dispatch settings ``torch.export``'s
    tracing must not inherit. Returns its result, raises its error."""
    outcome: dict[str, Any] = {}
    threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the kernels are sized with the caller's

    def target() -> None:
        try:
            torch.set_num_threads(threads)
            with torch.no_grad():
                outcome["result"] = function(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="qada-ahead-of-time-step")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _plain(value: Any) -> Any:
    """``value`` as a hashable, comparable setting (lists and dicts as tuples; dataclasses by their fields);
    anything else (a tensor: the step reads it as an input or not at all) by its type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_plain(item) for item in value)
    if isinstance(value, dict):
        return tuple((_plain(key), _plain(item)) for key, item in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), settings(value))
    return type(value)


_SCALARS = frozenset({type(None), bool, int, float, str})


def settings(part: Any) -> tuple:
    """The configuration of a component (a dataclass): its fields' values, as :func:`_plain` makes them."""
    values = _field_values(type(part))(part)
    if all(type(value) in _SCALARS for value in values):  # the common case, as they are
        return values
    return tuple(_plain(value) for value in values)


@functools.cache
def _field_values(kind: type) -> Any:
    """``part -> (its fields' values)`` for a dataclass type: one ``attrgetter`` (this is on every call's path)."""
    names = [field.name for field in dataclasses.fields(kind)]
    if len(names) == 1:
        single = operator.attrgetter(names[0])
        return lambda part: (single(part),)
    return operator.attrgetter(*names) if names else (lambda part: ())


@functools.cache
def _tensor_guards() -> Any:
    """``torch.compile``'s C++ tensor guard class, or ``None`` where this version of torch has none (looked up once)."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None
    return TensorGuards


def tensor_guard(leaves: list[torch.Tensor]) -> Any:
    """A check in C++ that tensors have the dtype, device, shape, strides and ``requires_grad`` of ``leaves``:
    ``guard.check(*tensors) -> bool`` (``torch.compile``'s own tensor guard, ~4 us for 28 tensors against ~30-60 us
    for the same in Python), or ``None`` where this version of torch has none that works."""
    guards = _tensor_guards()
    if guards is None:
        return None
    try:
        guard = guards(*leaves, dynamic_dims_sizes=[list(tensor.shape) for tensor in leaves],
                       dynamic_dims_strides=[list(tensor.stride()) for tensor in leaves])
        return guard if guard.check(*leaves) else None
    except Exception:  # noqa: BLE001 - a private API: without it every call takes the key in Python
        return None


class StepKey(NamedTuple):
    """What a compiled package is for (:meth:`AheadOfTimeStep.key`): one entry per distinct key."""

    structure: tuple
    """Which inputs are ``None``, the state dictionaries' keys, the floats baked into the step."""
    tensors: tuple
    """``(dtype, shape, strides)`` of every input tensor, in :func:`flatten_arguments`' order."""
    configuration: tuple
    """The components' settings (:meth:`AheadOfTimeStep.configuration`)."""
    threads: int
    """``torch.get_num_threads()``: the kernels' OpenMP teams are sized when compiled."""
    dtype: torch.dtype
    """``torch.get_default_dtype()``."""


class _Recent(NamedTuple):
    """The last call's key (its tensors' part checked again by ``guard``, the rest in Python), gradient mode and
    entry: what the fast path compares a call with."""

    key: StepKey
    grad: bool
    guard: Any
    entry: tuple


class AheadOfTimeStep:
    """A layer step function (``layer_step`` with the run's components bound as keyword arguments) compiled ahead of
    time per key (see the module's docstring). Call with the step's positional arguments; returns its
    :class:`~qada.models.step_parts.LayerStepResult`, or ``None`` where it declines.

    Attributes:
        parts: the components whose fields are part of the key (every criterion, the moment source, the window).
        own: whether every part is one of qada's own dataclasses (else every call declines).
        entries: key -> the loaded package's runner, per key compiled or loaded.
        declined: why the last key that was declined was (``None``: none was); ``error``: the exception of the last
            export or compilation that failed (``None``: none did).
        loaded: how many packages came from the cache directory rather than a compilation.
        folder: where packages are kept (``None``: :data:`AOT_DIRECTORY` in Inductor's cache directory).
    """

    def __init__(self, function: Any, bound: dict[str, Any], parts: list[Any]) -> None:
        self.function, self.bound = function, bound
        self.parts = parts
        self.entries: dict[StepKey, Any] = {}
        self._refused: set[StepKey] = set()
        self.folder: str | None = None
        self.loaded = 0
        self.own = all(is_built_in(part) and dataclasses.is_dataclass(part) for part in parts)
        self.declined: str | None = None if self.own else "a component is not one of qada's own"
        self.error: Exception | None = None
        self._recent: _Recent | None = None  # the last call's key and entry, for the fast path

    def configuration(self) -> tuple:
        """The parts' configuration (:func:`settings` of each), as the key holds it."""
        return tuple(settings(part) for part in self.parts)

    def key(self, leaves: list[torch.Tensor], structure: tuple, configuration: tuple | None = None) -> StepKey | None:
        """The call's key, or ``None`` where the step cannot run ahead of time (a tensor off the CPU, gradients);
        ``configuration``: :meth:`configuration` where the caller has it."""
        grad = torch.is_grad_enabled()
        meta = []
        for tensor in leaves:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_cpu or (grad and tensor.requires_grad):
                return None
            meta.append((tensor.dtype, tensor.shape, tensor.stride()))
        if configuration is None:
            configuration = self.configuration()
        return StepKey(structure, tuple(meta), configuration, torch.get_num_threads(), torch.get_default_dtype())

    def _recent_entry(self, leaves: list[torch.Tensor], structure: tuple, configuration: tuple) -> tuple | None:
        """The last call's entry where this call has its key (the fast path: the tensors checked in C++,
        :func:`tensor_guard`), else ``None``."""
        recent = self._recent
        if recent is None:
            return None
        key = recent.key
        if (key.configuration != configuration or key.structure != structure
                or key.threads != torch.get_num_threads() or key.dtype != torch.get_default_dtype()
                or recent.grad != torch.is_grad_enabled() or not recent.guard.check(*leaves)):
            return None
        return recent.entry

    def __call__(self, args: tuple) -> Any:
        if not self.own:
            return None
        leaves, structure = flatten_arguments(args)
        configuration = self.configuration()
        entry = self._recent_entry(leaves, structure, configuration)
        if entry is None:
            entry = self._entry(args, leaves, structure, configuration)
            if entry is None:
                return None
        runner, positions, count = entry
        outputs = runner.run(leaves)
        parts: list[torch.Tensor | None] = [None] * count
        for position, tensor in zip(positions, outputs, strict=True):
            parts[position] = tensor
        return unflatten_result(parts)

    def _entry(self, args: tuple, leaves: list[torch.Tensor], structure: tuple, configuration: tuple
               ) -> tuple | None:
        """The entry of this call's key, compiled or loaded where it is new; ``None`` where it declines. Kept as
        the recent entry for the next call's fast path."""
        key = self.key(leaves, structure, configuration)
        if key is None or key in self._refused:
            return None
        entry = self.entries.get(key)
        if entry is None:
            if self.entries and all(seen[:2] != key[:2] for seen in self.entries):  # (structure, tensors)
                self.declined = "another cache size (or batch, or dtype) than the first"
                return None
            if len(self.entries) >= MAX_ENTRIES:
                self.declined = f"more than {MAX_ENTRIES} configurations"
                return None
            try:
                entry = _in_fresh_thread(self._compile, args, leaves, key)
            except Exception as error:  # noqa: BLE001 - any failure: torch.compile's route takes the step
                self._refused.add(key)
                self.error = error
                first = (str(error).strip().splitlines() or [""])[0][:300]
                self.declined = f"{type(error).__name__}: {first}"
                return None
            self.entries[key] = entry
        self._remember(leaves, key, entry)
        return entry

    def _remember(self, leaves: list[torch.Tensor], key: StepKey, entry: tuple) -> None:
        """Keep ``entry`` of ``key`` (``leaves``' key) for the next call's fast path (:meth:`_recent_entry`)."""
        guard = tensor_guard(leaves)
        self._recent = None if guard is None else _Recent(key, torch.is_grad_enabled(), guard, entry)

    def _compile(self, args: tuple, leaves: list[torch.Tensor], key: StepKey) -> tuple[Any, list[int], int]:
        """Export the step for ``args``, compile it (or load it from the cache directory): ``(runner, positions of
        the non-``None`` outputs, output count)``."""
        from torch.utils import _pytree as pytree

        function, bound = self.function, self.bound
        scale, softcap = args[5], args[10]
        inputs = args[:5] + args[6:10] + args[11:]

        class Step(torch.nn.Module):
            def forward(self, query, keys, values, start, end, layer, moment_state, criterion_states,  # noqa: ANN001
                        sink_logits, sums):
                result = function(query, keys, values, start, end, scale, layer, moment_state, criterion_states,
                                  sink_logits, softcap, sums, **bound)
                return tuple(flatten_result(result))

        # without the fake tensor cache, which may hold entries of a model's own compilation (other symbols)
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            program = torch.export.export(Step(), inputs, strict=False)
        if program.constants or program.state_dict:
            raise ValueError(f"the step captures tensors as constants: {sorted(program.constants)[:4]}")
        node = unbacked_node(program.graph_module.graph)
        if node is not None:
            raise HostReadError(f"it reads a device value on the host ({node})")
        order = [leaf for leaf in pytree.tree_flatten(inputs)[0] if isinstance(leaf, torch.Tensor)]
        if len(order) != len(leaves) or any(a is not b for a, b in zip(order, leaves, strict=True)):
            raise ValueError("the exported inputs are not in the order of flatten_arguments")
        out_spec = program.call_spec.out_spec
        shape = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
        positions = [index for index, item in enumerate(shape) if item is not None]
        path = self._package(program, key)
        runner = torch._inductor.aoti_load_package(path)
        return runner.loader, positions, len(shape)

    def _package(self, program: Any, key: StepKey) -> str:
        """The compiled package of ``program`` in the cache directory, compiled now where it is not there yet."""
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        from qada.version import __version__

        options = cpu_step_options()
        material = "\n".join([__version__, torch.__version__, str(pick_vec_isa()), repr(key[:2]), repr(key[3:]),
                              repr(sorted(options)), options["post_grad_custom_post_pass"].uuid().hex(),
                              str(program.graph_signature), str(program.call_spec),
                              program.graph_module.code])  # (the CPU's vector ISA: a cache folder may be shared)
        digest = hashlib.sha256(material.encode()).hexdigest()[:40]
        folder = self.folder or os.path.join(cache_dir(), AOT_DIRECTORY)
        path = os.path.join(folder, f"{digest}.pt2")
        if os.path.exists(path):
            self.loaded += 1
            return path
        os.makedirs(folder, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".pt2", dir=folder)
        os.close(handle)
        try:
            with warnings.catch_warnings():  # torch's own pickling of a tree spec warns of its deprecated API
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                torch._inductor.aoti_compile_and_package(program, package_path=partial, inductor_configs=options)
            os.replace(partial, path)  # whole or not at all, for a process that loads it meanwhile
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return path
