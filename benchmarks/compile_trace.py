"""What ``torch.compile`` makes of the ``triton_fused`` layer step for a CUDA GPU, traced on the CPU (no GPU needed).

    python benchmarks/compile_trace.py                   # SmolLM2, a 256-token pass-key prompt
    python benchmarks/compile_trace.py --length 128 --out /tmp/trace

A compiled decode step on a GPU holds the fused layer step's Triton launches as graph nodes. Two things decide what
it costs there beyond the launches themselves, and both are settled while tracing, before any kernel runs:

* **which tensors each launch writes.** torch reads it from the kernel's Triton IR: a tensor it takes as written
  is copied before the launch unless Inductor can write it in place, and a launch it cannot analyse (a defaulted
  argument left out, an unknown operation) has *every* tensor argument taken as written, the KV cache included;
* **what else the graph holds**: operations besides the launches, views and allocations become kernels.

This script prefills the embedded model on the CPU with each configuration, stops at the first decode step's layer
step, and traces that step as ``torch.compile(fullgraph=True)`` does on a GPU: Dynamo with the kernels as
user-defined Triton kernels, the write analysis against an sm_90 target, AOT autograd's functionalisation keeping
the input mutations, then Inductor's re-inplacing pass. The tensors are fake ones on the ``meta`` device (a CPU
build of torch cannot make views of fake CUDA tensors); nothing is launched. It reports per configuration the
launches in order, the tensors each writes, the copies left after re-inplacing, any other operation, the tensors
made from host data, and whether an analysis fell back; each step is traced at two cache sizes (static shapes, then
the symbolic ones a second size compiles). Inductor's code generation, its scheduling and CUDA graphs are not run:
their kernel counts are the GPU suite's (``benchmarks/run.py --gpu``).

It then traces the model's whole decode step (``torch.compile(model.forward)``) dense and with each configuration:
qada's step is one opaque operation per global layer there, and the table says what else the graph holds.

It changes process-wide state (torch's Triton detection, Triton's active driver): run it as a process of its own,
without ``TRITON_INTERPRET``. Writes ``<out>/compile-trace-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import logging
import operator
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS: dict[str, dict[str, Any]] = {  # name: build_run arguments (stored moments unless said)
    "qada": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton_fused"}},
    "qada, current moments": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton_fused"},
                              "moments": "current"},
    "qada, decide_once": {"criterion": {"name": "qada", "tau": 0.6},
                          "executor": {"name": "triton_fused", "decide_once": True}},
    "qada_tail": {"criterion": {"name": "qada_tail", "tau": 0.3}, "executor": {"name": "triton_fused"}},
    "qada_tail, pages spread": {"criterion": {"name": "qada_tail", "tau": 0.3},
                                "executor": {"name": "triton_fused", "decide_once": True, "pages_per_program": 4}},
    "qada_tail_budget": {"criterion": {"name": "qada_tail_budget", "sparsity": 0.85},
                         "executor": {"name": "triton_fused"}},
    "qada_tail_budget, per group, current": {
        "criterion": {"name": "qada_tail_budget", "sparsity": 0.85, "per_group": True},
        "executor": {"name": "triton_fused"}, "moments": "current"},
}  # fmt: skip

NO_KERNEL = {"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.detach", "aten.alias"}
"""Graph operations that launch nothing (allocations, aliases); views are recognised by their schema."""


def pretend_cuda_triton() -> None:
    """Make this process trace Triton kernels as it would on a CUDA GPU of compute capability 9.0, without one:
    torch takes Triton as usable, Triton's active driver reports an sm_90 target (its only use here: compiling a
    kernel's IR for the write analysis), and the executors accept tensors that are not on a GPU (the fake ones
    traced here). Process-wide; irreversible."""
    import torch
    import torch.utils._triton
    import triton
    from triton.backends.compiler import GPUTarget

    from qada.attention import _triton_kernel, fused, triton_decode

    if _triton_kernel.INTERPRETED:
        raise RuntimeError("tracing for a GPU needs the kernels compiled, not interpreted: unset TRITON_INTERPRET")

    class Sm90Driver:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cuda", 0)

        def get_current_device(self) -> int:
            return 0

    torch.utils._triton.has_triton = lambda: True
    triton.runtime.driver.set_active(Sm90Driver())
    real = triton_decode.check_triton_runtime

    def check(*args, **kwargs) -> None:  # eagerly (the prefill: fake CUDA) nothing; traced, the real one
        if torch.compiler.is_compiling():
            real(*args, **kwargs)

    for module in (fused, triton_decode):
        module.check_triton_runtime = check


class StopAtLayerStep(Exception):
    """Raised by the capture once it holds a layer step's arguments."""


def prefill_static(model: Any, ids: Any, capacity: int | None = None, mask: Any = None) -> dict[str, Any]:
    """Prefill ``ids [b, T]`` (``mask [b, T]``: 0 at a row's left padding; default none) into a new static cache of
    ``capacity`` slots (default ``T + 4``; with whatever is attached to ``model``) and return the keyword arguments
    of the first decode step (its greedy tokens, the mask, the cache)."""
    import torch
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=capacity or ids.shape[1] + 4)
    with torch.no_grad():
        mask = torch.ones_like(ids) if mask is None else mask
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    return {"input_ids": token, "attention_mask": torch.cat([mask, torch.ones_like(token)], 1),
            "past_key_values": cache, "use_cache": True}


def capture_layer_step(model: Any, run: Any, ids: Any, mask: Any = None) -> tuple[Any, tuple]:
    """Prefill ``ids [b, T]`` (``mask``: as for :func:`prefill_static`) into a static cache with ``run`` attached
    and start one decode step: ``(the run's LayerStep, the arguments of its first call)``; the step itself is not
    run (its kernels cannot run here)."""
    import torch

    from qada.models import attach
    from qada.models.layer_step import LayerStep

    captured: dict[str, Any] = {}
    original = LayerStep.__call__

    def capture(self, buffered, *args):  # noqa: ANN001, ANN202
        captured["step"], captured["args"] = self, args
        raise StopAtLayerStep

    attach(model, run)
    run.reset_stats()  # a new sequence (the run may have captured another)
    LayerStep.__call__ = capture
    try:
        with torch.no_grad(), contextlib.suppress(StopAtLayerStep):
            model(**prefill_static(model, ids, mask=mask))
    finally:
        LayerStep.__call__ = original
        run.remove()
    if "step" not in captured:
        raise RuntimeError("the decode step never reached the run's layer step")
    return captured["step"], captured["args"]


def _fake_tensor_updater(updater: Any, graph: Any) -> Any:
    """Inductor's ``FakeTensorUpdater`` for ``graph``: torch >= 2.12 takes the graph module, 2.11 (the GPU machines'
    torch) its graph."""
    takes_module = "gm" in inspect.signature(updater.__init__).parameters
    return updater(graph if takes_module else graph.graph)


def trace_layer_step(step: Any, *arg_sets: tuple) -> dict[str, Any]:
    """Trace ``step`` (a fused :class:`~qada.models.layer_step.LayerStep`) on fake ``meta`` copies of each of
    ``arg_sets`` in turn, as one compiled function (:func:`pretend_cuda_triton` first): the first cache size
    compiles with static shapes, a second one once more with symbolic sizes, a third reuses that graph.

    Returns ``{"graphs": [{"launches": [{"kernel", "writes", "copies"}], "ops": {name: count}, "constants": n}],
    "analysis_fallbacks": [message], "error": None or the compile error's first lines}``, one entry per graph
    compiled: ``writes`` the tensors the write analysis found, ``copies`` those still copied after re-inplacing,
    ``ops`` the graph's operations that are neither launches, views nor allocations, ``constants`` the tensors the
    step makes from host data (each a copy to the device per call), ``dtype_views`` the dtypes of its
    reinterpreting views (``Tensor.view(dtype)``; Inductor cannot lower one to or from bool on torch 2.11)."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._higher_order_ops import triton_kernel_wrap
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from qada.models.layer_step import compile_layer_step

    if step.fused is None:
        raise ValueError("expected a fused layer step (executor 'triton_fused')")
    report: dict[str, Any] = {"graphs": [], "analysis_fallbacks": [], "error": None}

    def record(graph: torch.fx.GraphModule, inputs: list) -> Any:
        launches = [node for node in graph.graph.nodes if node.target is torch.ops.higher_order.
                    triton_kernel_wrapper_functional]  # fmt: skip
        writes = [list(node.kwargs["tensors_to_clone"]) for node in launches]
        with V.set_fake_mode(detect_fake_mode(inputs)):
            reinplace_inplaceable_ops(_fake_tensor_updater(FakeTensorUpdater, graph), graph.graph)
        found: dict[str, Any] = {"launches": [], "ops": dict(_kernel_ops(graph, skip=launches)),
                                 # a tensor made in the step from host data (a copy to the device per call)
                                 "constants": sum(node.op == "get_attr" for node in graph.graph.nodes),
                                 # reinterpreted dtypes: Inductor (torch 2.11) cannot lower one to or from bool
                                 "dtype_views": [str(node.args[1]) for node in graph.graph.nodes
                                                 if node.target is torch.ops.aten.view.dtype]}
        for node, written in zip(launches, writes, strict=True):
            kernel = triton_kernel_wrap.kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            found["launches"].append({"kernel": kernel.fn.__name__, "writes": written,
                                      "copies": list(node.kwargs["tensors_to_clone"])})
        report["graphs"].append(found)
        return graph

    class Fallbacks(logging.Handler):
        def emit(self, entry: logging.LogRecord) -> None:
            if "assuming every input is mutated" in entry.getMessage():
                report["analysis_fallbacks"].append(f"{entry.getMessage()}: {entry.exc_info and entry.exc_info[1]}")

    step.fused.to_device(torch.device("meta"))  # as a run's prefill does on the GPU
    compiled = compile_layer_step(dict(step.eager.keywords),  # the fused step, its components bound
                                  aot_autograd(fw_compiler=record, keep_inference_input_mutations=True),
                                  step.eager.func)
    logger = triton_kernel_wrap.log  # (the logger that module writes to, not one named after it)
    handler = Fallbacks(logging.WARNING)
    logger.addHandler(handler)
    try:
        for args in arg_sets:
            with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
                fake = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                                if isinstance(t, torch.Tensor) else t, args)  # fmt: skip
                compiled(*fake)
    except Exception as error:  # noqa: BLE001 - reported: a graph break or a failed analysis is the finding
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        report["error"] = f"{type(error).__name__}: {' '.join(lines[:2])[:400]}"
    finally:
        logger.removeHandler(handler)
    return report


class StopAfterTrace(Exception):
    """Raised by :func:`trace_decode_forward`'s compiler once it holds the graph (nothing is run)."""


def trace_decode_forward(model: Any, run: Any | None, ids: Any) -> dict[str, Any]:
    """The graph ``torch.compile(model.forward, fullgraph=True)`` traces for one decode step after an eager prefill of
    ``ids [1, T]`` into a static cache, with ``run`` attached (``None``: the plain model, dense attention):
    ``{"ops": {name: count}, "total": n, "qada_steps": n, "launches": n}``. ``ops`` counts the graph's operations
    besides views and allocations; a global layer's qada step is one opaque ``qada.decode_buffer`` operation
    (``qada_steps``; its own compiled graph is :func:`trace_layer_step`'s), and ``launches`` counts Triton launches
    traced into the model's graph itself (none expected)."""
    import torch
    from torch._dynamo.backends.common import aot_autograd

    from qada.models import attach

    found: dict[str, Any] = {}

    def record(graph: torch.fx.GraphModule, inputs: list) -> Any:
        ops = _kernel_ops(graph)
        launches = sum(n for name, n in ops.items() if "triton_kernel_wrapper" in name)
        found.update(ops=dict(ops), total=sum(ops.values()), qada_steps=ops.get("qada.decode_buffer", 0),
                     launches=launches)
        raise StopAfterTrace

    if run is not None:
        attach(model, run)
        run.reset_stats()
    try:
        step = prefill_static(model, ids)
        forward = torch.compile(model.forward, fullgraph=True, dynamic=False,
                                backend=aot_autograd(fw_compiler=record, keep_inference_input_mutations=True))
        error = None
        try:  # (the compiler's exception arrives wrapped by dynamo)
            with torch.no_grad():
                forward(**step)
        except Exception as caught:  # noqa: BLE001 - re-raised below unless it is the trace's own stop
            error = caught
    finally:
        if run is not None:
            run.remove()
        torch._dynamo.reset()
    if "total" not in found:
        raise RuntimeError("the decode step's graph was never traced") from error
    return found


def _kernel_ops(graph: Any, skip: Any = ()) -> collections.Counter:
    """``{operation name: count}`` of ``graph``'s (an FX graph module's) calls that are not in ``skip``, not a view
    or an allocation (:data:`NO_KERNEL`), and not host arithmetic on sizes or a tuple item: what may launch work."""
    import torch

    ops: collections.Counter = collections.Counter()
    for node in graph.graph.nodes:
        if node.op != "call_function" or node in skip or node.target is operator.getitem \
                or isinstance(node.meta.get("val"), (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue
        name = str(getattr(node.target, "overloadpacket", node.target))
        if name not in NO_KERNEL and not _is_view(node.target):
            ops[name] += 1
    return ops


def _is_view(target: Any) -> bool:
    """Whether ``target`` (an aten overload) returns a view of its input (launches nothing)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _copies(graph: dict[str, Any]) -> int:
    """Tensors copied before the launches of one traced graph."""
    return sum(len(launch["copies"]) for launch in graph["launches"])


def _each(row: dict[str, Any], value: Any) -> str:
    """``value(graph)`` of the row's graphs: one value where they agree, else each, joined by " / "."""
    values = [str(value(graph)) for graph in row["graphs"]]
    return " / ".join(values) if len(set(values)) > 1 else (values[0] if values else "n/a")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=256, help="prompt length in tokens")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: kernels as a GPU compiles them
    os.environ["QADA_COMPILE"] = "0"  # the runs prefill eagerly; the trace compiles the step itself

    import torch

    from benchmarks.common import machine_info, table, write_results
    from qada.eval.passkey import passkey_prompt
    from qada.models import build_run, load_default_model, prepare_run

    pretend_cuda_triton()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model, tokenizer = load_default_model()
    ids = passkey_prompt(tokenizer, length=args.length, depth=0.5).input_ids
    longer = passkey_prompt(tokenizer, length=args.length + 64, depth=0.5).input_ids
    rows = {}
    for name, config in CONFIGS.items():
        run = prepare_run(build_run(moments=config.get("moments", "stored"), criterion=config["criterion"],
                                    executor=config["executor"]), model, tokenizer)
        step, args_first = capture_layer_step(model, run, ids)
        _, args_second = capture_layer_step(model, run, longer)  # the same run and step at a second cache size
        rows[name] = row = trace_layer_step(step, args_first, args_second)
        print(f"{name}: {len(row['graphs'])} graphs, launches {[len(g['launches']) for g in row['graphs']]}, "
              f"copies {[_copies(g) for g in row['graphs']]}, other ops {[g['ops'] for g in row['graphs']]}, "
              f"error {row['error']}", flush=True)
    forward = {"dense": trace_decode_forward(model, None, ids)}
    for name, config in CONFIGS.items():
        run = prepare_run(build_run(moments=config.get("moments", "stored"), criterion=config["criterion"],
                                    executor=config["executor"]), model, tokenizer)
        forward[name] = trace_decode_forward(model, run, ids)
        print(f"{name}, the model's decode step: {forward[name]}", flush=True)
    import triton

    info = machine_info("cpu")
    results = {"command": f"python benchmarks/compile_trace.py --length {args.length}", "machine": info,
               "triton": triton.__version__, "model": "SmolLM2-135M (embedded)", "prompt_tokens": args.length,
               "rows": rows, "forward": forward}
    lines = ["# The compiled `triton_fused` layer step as traced for a GPU (on the CPU), SmolLM2-135M", "",
             f"Command: `{results['command']}`; torch {torch.__version__}, triton {triton.__version__}, Triton's "
             "write analysis against sm_90, fake `meta` tensors, AOT functionalisation keeping input mutations, "
             "then Inductor's re-inplacing pass (no code generation, no kernel run). Each configuration's step is "
             f"traced at two cache sizes ({ids.shape[1] + 4} and {longer.shape[1] + 4} slots): the first compiles "
             "with static shapes, the second once more with symbolic sizes (*graphs*); the columns hold for every "
             "graph (the first's, then the second's where they differ). *writes*: the tensors the analysis found "
             "each launch writes; *copies*: those still copied before the launch after re-inplacing; *other ops*: "
             "graph operations besides the launches, views and allocations; *constants*: tensors the step makes "
             "from host data (a copy to the device per call); *fallbacks*: times the analysis could not read a "
             "launch and took every tensor argument as written (it runs in Dynamo and again in "
             "functionalisation).", "",
             table(["configuration", "graphs", "launches", "copies", "other ops", "constants", "fallbacks",
                    "traced"],
                   [[name, len(row["graphs"]), _each(row, lambda g: " → ".join(x["kernel"] for x in g["launches"])),
                     _each(row, _copies), _each(row, lambda g: g["ops"] or "none"),
                     _each(row, lambda g: g["constants"]), len(row["analysis_fallbacks"]),
                     "yes" if row["error"] is None else row["error"]]
                    for name, row in rows.items()]), "", "Tensors each launch writes (first graph):", ""]
    for name, row in rows.items():
        first = row["graphs"][0]["launches"] if row["graphs"] else []
        lines.append(f"- **{name}**: " + "; ".join(f"`{x['kernel']}` {', '.join(x['writes'])}" for x in first))
    layers = model.config.num_hidden_layers
    dense = forward["dense"]
    lines += ["", "## The model's decode step around it", "",
              "`torch.compile(model.forward, fullgraph=True)` of one decode step after an eager prefill, traced the "
              "same way (CPU tensors here; the graph is the model's, before Inductor fuses anything): *operations* "
              "counts the graph's operations besides views and allocations, *qada steps* the opaque "
              "`qada::decode_buffer` operations (one per global layer: its graph is the layer step's above), "
              "*launches* Triton launches traced into the model's graph itself, *others vs dense* the operations "
              "besides qada's steps against the dense model's whole graph, per layer.", "",
              table(["configuration", "operations", "qada steps", "launches", "others vs dense, per layer"],
                    [[name, row["total"], row["qada_steps"], row["launches"],
                      f"{(row['total'] - row['qada_steps'] - dense['total']) / layers:+.2f}"]
                     for name, row in forward.items()])]
    paths = write_results(args.out, "compile-trace-cpu", results, "\n".join(lines) + "\n")
    print(paths[1].read_text())
    return paths[1]


if __name__ == "__main__":
    main()
