"""How a layer step is compiled: the ``compile`` setting's backend (:func:`resolve_compile`), ``torch.compile`` on a
code object of the step's own (:func:`compile_own`), a backend that refuses host reads (:class:`HostReadError`), and
Inductor's options for the step on the CPU and on a GPU."""

from __future__ import annotations

import itertools
import os
import types
from typing import Any

import torch

__all__ = ["COMPILE_ENV", "HostReadError", "compile_own", "cpu_step_options", "failure_reason", "gpu_step_options",
           "resolve_compile", "unbacked_node"]

COMPILE_ENV = "QADA_COMPILE"
"""Environment variable giving the default of ``compile`` (``0``/``false``: eager; ``1``/``true``: inductor; any
other value: that ``torch.compile`` backend, e.g. ``aot_eager``) where :func:`qada.apply` is not told."""


def resolve_compile(compile: Any) -> Any:
    """The ``torch.compile`` backend of ``compile`` (``None``: eager): ``True`` is inductor, a string or a callable
    a backend, ``None`` the :data:`COMPILE_ENV` default (inductor when unset)."""
    if compile is None:
        value = os.environ.get(COMPILE_ENV, "1").strip().lower()
        compile = {"0": False, "false": False, "no": False, "off": False, "1": True, "true": True, "yes": True,
                   "on": True, "": True}.get(value, value)
    if compile is True:
        return "inductor"
    if compile is False:
        return None
    if isinstance(compile, str) and compile:
        known = torch._dynamo.list_backends(exclude_tags=())
        if compile not in known:
            raise ValueError(f"expected compile to be a bool or one of the torch.compile backends {known} but got "
                             f"{compile!r} (from {COMPILE_ENV} when not given)")
        return compile
    if callable(compile):
        return compile
    raise ValueError(f"expected compile to be a bool or a torch.compile backend name but got {compile!r}")


def compile_own(function: Any, prefix: str, backend: Any) -> Any:
    """``function`` compiled by ``torch.compile`` (``fullgraph=True``, host reads refused) on a copy of its code
    object with a name of its own: dynamo keeps its cache and what it learnt about the inputs (which sizes and floats
    change) per code object and per (file, line, name), so one run's compiled function never recompiles or evicts
    another's (another model's scale, another cache size)."""
    name = f"{prefix}_{next(_STEPS)}"
    own = types.FunctionType(function.__code__.replace(co_name=name, co_qualname=name), function.__globals__, name,
                             function.__defaults__, function.__closure__)
    # dynamic=None: the first cache size compiles with static shapes; a run that meets a second one (an evaluation
    # whose prompts differ in length) compiles once more with the sizes symbolic, and never again
    return torch.compile(own, backend=_refusing_host_reads(backend), fullgraph=True, dynamic=None)


_STEPS = itertools.count()


class HostReadError(RuntimeError):
    """The traced layer step reads a value from the device on the host (a sync; no CUDA graph can hold it)."""


def _refusing_host_reads(backend: Any) -> Any:
    """``backend``, refusing a traced graph in which a value computed on the device decides something on the host
    (``item``, ``tolist``, ``nonzero``, a data-dependent shape): ``torch.compile`` traces those into the graph, but
    the compiled step would then wait for the device at every layer, and a CUDA graph could not capture it."""
    from torch._dynamo import lookup_backend

    compile_graph = lookup_backend(backend) if isinstance(backend, str) else backend

    def refusing(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        node = unbacked_node(graph.graph)
        if node is not None:
            where = "".join(node.meta.get("stack_trace", "").strip().splitlines()[-2:]).strip()
            raise HostReadError(f"it reads a device value on the host ({node.target}): {where}")
        devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
        if backend == "inductor" and devices in ({"cpu"}, {"cuda"}):
            from torch._inductor.compile_fx import compile_fx

            options = cpu_step_options() if devices == {"cpu"} else gpu_step_options()
            return compile_fx(graph, example_inputs, config_patches=options)
        return compile_graph(graph, example_inputs)

    return refusing


def cpu_step_options() -> dict[str, Any]:
    """Inductor's options for the layer step on the CPU, scoped to its own compilation (``torch.compile``'s route
    and the ahead-of-time one, :mod:`qada.models.ahead_step`): a C++ wrapper around the kernels instead of a Python
    one (~60 us less per layer step on a 2-core CPU), and the few-row products as fused loops instead of BLAS calls
    (:class:`~qada.models.small_matmul.SmallMatmulPass`)."""
    from qada.models.small_matmul import SmallMatmulPass

    return {"cpp_wrapper": True, "post_grad_custom_post_pass": SmallMatmulPass()}


def gpu_step_options() -> dict[str, Any]:
    """Inductor's options for the layer step on a CUDA GPU, scoped to its own compilation: the few-row products as
    multiply-and-sum loops fused into the kernels around them (:class:`~qada.models.small_matmul.SmallMatmulPass`)
    instead of a cuBLAS launch each (a ``qada`` step's window scores, a ``qada_tail`` step's heavy keys and page
    bounds: three to six launches per layer)."""
    from qada.models.small_matmul import SmallMatmulPass

    return {"post_grad_custom_post_pass": SmallMatmulPass()}


def unbacked_node(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The first operation of a traced ``graph`` whose result has a size or value only known on the host (an
    unbacked symbol: ``item``, ``nonzero``, ...), or ``None``."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if node.op in ("call_method", "call_function") and free_unbacked_symbols(value):
            return node
    return None


def failure_reason(error: Exception) -> str:
    """The first lines of a compile error, which say what could not be traced."""
    text = str(error).replace("backend='refusing' raised: ", "")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("Set TORCHDYNAMO")]
    return " ".join(lines[:3])[:400] or type(error).__name__
