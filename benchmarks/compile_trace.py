"""What ``torch.compile`` makes of the ``triton_fused`` layer step for a CUDA GPU, traced on the CPU (no GPU needed).

    python benchmarks/compile_trace.py                   # SmolLM2, a 256-token pass-key prompt
    python benchmarks/compile_trace.py --length 128 --out /tmp/trace

A compiled decode step on a GPU holds the fused layer step's Triton launches as graph nodes. Two things decide what
it costs there beyond the launches themselves, and both are settled while tracing, before any kernel runs:

* **which tensors each launch writes.** torch reads it from the kernel's Triton IR: a tensor it takes as written
  is copied before the launch unless Inductor can write it in place, and a launch it cannot analyse (a defaulted
  argument left out, an unknown operation) has *every* tensor argument taken as written: the KV cache copied at
  every layer;
* **what else the graph holds**: operations besides the launches, views and allocations become kernels.

This script prefills the embedded model on the CPU with each configuration, stops at the first decode step's layer
step, and traces that step as ``torch.compile(fullgraph=True)`` does on a GPU: Dynamo with the kernels as
user-defined Triton kernels, the write analysis against an sm_90 target, AOT autograd's functionalisation keeping
the input mutations, then Inductor's re-inplacing pass. The tensors are fake ones on the ``meta`` device (a CPU
build of torch cannot make views of fake CUDA tensors); nothing is launched. It reports per configuration the
launches in order, the tensors each writes, the copies left after re-inplacing, any other operation, and whether
an analysis fell back. Inductor's code generation, its scheduling and CUDA graphs are not run: their kernel counts
are the GPU suite's (``benchmarks/run.py --gpu``).

It changes process-wide state (torch's Triton detection, Triton's active driver): run it as a process of its own,
without ``TRITON_INTERPRET``. Writes ``<out>/compile-trace-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
    for module in (fused, triton_decode):
        module.check_triton_runtime = lambda device: None


class StopAtLayerStep(Exception):
    """Raised by the capture once it holds a layer step's arguments."""


def capture_layer_step(model: Any, run: Any, ids: Any) -> tuple[Any, tuple]:
    """Prefill ``ids [1, T]`` into a static cache with ``run`` attached and start one decode step: ``(the run's
    LayerStep, the arguments of its first call)``; the step itself is not run (its kernels cannot run here)."""
    import torch
    from transformers import StaticCache

    from qada.models import attach
    from qada.models.layer_step import LayerStep

    captured: dict[str, Any] = {}
    original = LayerStep.__call__

    def capture(self, buffered, *args):  # noqa: ANN001, ANN202
        captured["step"], captured["args"] = self, args
        raise StopAtLayerStep

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
    attach(model, run)
    LayerStep.__call__ = capture
    try:
        with torch.no_grad():
            mask = torch.ones_like(ids)
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            with contextlib.suppress(StopAtLayerStep):
                model(input_ids=token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1),
                      past_key_values=cache, use_cache=True)
    finally:
        LayerStep.__call__ = original
        run.remove()
    if "step" not in captured:
        raise RuntimeError("the decode step never reached the run's layer step")
    return captured["step"], captured["args"]


def trace_layer_step(step: Any, args: tuple) -> dict[str, Any]:
    """Trace ``step`` (a fused :class:`~qada.models.layer_step.LayerStep`) on fake ``meta`` copies of ``args``
    (:func:`pretend_cuda_triton` first). Returns ``{"launches": [{"kernel", "writes", "copies"}], "ops": {name:
    count}, "constants": n, "analysis_fallbacks": [message], "error": None or the compile error's first lines}``:
    ``writes`` the tensors the write analysis found, ``copies`` those still copied after re-inplacing, ``ops`` the
    graph's operations that are neither launches, views nor allocations, ``constants`` the tensors the step makes
    from host data (each a copy to the device per call)."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._higher_order_ops import triton_kernel_wrap
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from qada.models.fused_step import fused_layer_step
    from qada.models.layer_step import compile_layer_step

    if step.fused is None:
        raise ValueError("expected a fused layer step (executor 'triton_fused')")
    report: dict[str, Any] = {"launches": [], "ops": collections.Counter(), "constants": 0,
                              "analysis_fallbacks": [], "error": None}

    def record(graph: torch.fx.GraphModule, inputs: list) -> Any:
        launches = [node for node in graph.graph.nodes if node.target is torch.ops.higher_order.
                    triton_kernel_wrapper_functional]  # fmt: skip
        writes = [list(node.kwargs["tensors_to_clone"]) for node in launches]
        with V.set_fake_mode(detect_fake_mode(inputs)):
            reinplace_inplaceable_ops(FakeTensorUpdater(graph), graph.graph)
        for node, written in zip(launches, writes, strict=True):
            kernel = triton_kernel_wrap.kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            report["launches"].append({"kernel": kernel.fn.__name__, "writes": written,
                                       "copies": list(node.kwargs["tensors_to_clone"])})
        for node in graph.graph.nodes:
            if node.op == "get_attr":  # a tensor made in the step from host data (a copy to the device per call)
                report["constants"] += 1
            if node.op != "call_function" or node in launches or node.target is operator.getitem:
                continue
            name = str(getattr(node.target, "overloadpacket", node.target))
            if name not in NO_KERNEL and not _is_view(node.target):
                report["ops"][name] += 1
        return graph

    class Fallbacks(logging.Handler):
        def emit(self, entry: logging.LogRecord) -> None:
            if "assuming every input is mutated" in entry.getMessage():
                report["analysis_fallbacks"].append(f"{entry.getMessage()}: {entry.exc_info and entry.exc_info[1]}")

    step.fused.to_device(torch.device("meta"))  # as a run's prefill does on the GPU
    bound = dict(step._bound, executor=step.fused)
    compiled = compile_layer_step(bound, aot_autograd(fw_compiler=record, keep_inference_input_mutations=True),
                                  fused_layer_step)
    logger = triton_kernel_wrap.log  # (the logger that module writes to, not one named after it)
    handler = Fallbacks(logging.WARNING)
    logger.addHandler(handler)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            fake = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                            if isinstance(t, torch.Tensor) else t, args)  # fmt: skip
            compiled(*fake)
    except Exception as error:  # noqa: BLE001 - reported: a graph break or a failed analysis is the finding
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        report["error"] = f"{type(error).__name__}: {' '.join(lines[:2])[:400]}"
    finally:
        logger.removeHandler(handler)
    report["ops"] = dict(report["ops"])
    return report


def _is_view(target: Any) -> bool:
    """Whether ``target`` (an aten overload) returns a view of its input (launches nothing)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


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
    rows = {}
    for name, config in CONFIGS.items():
        run = prepare_run(build_run(moments=config.get("moments", "stored"), criterion=config["criterion"],
                                    executor=config["executor"]), model, tokenizer)
        rows[name] = trace_layer_step(*capture_layer_step(model, run, ids))
        row = rows[name]
        print(f"{name}: {len(row['launches'])} launches, copies "
              f"{sum(len(launch['copies']) for launch in row['launches'])}, other ops {row['ops']}, "
              f"error {row['error']}", flush=True)
    import triton

    info = machine_info("cpu")
    results = {"command": f"python benchmarks/compile_trace.py --length {args.length}", "machine": info,
               "triton": triton.__version__, "model": "SmolLM2-135M (embedded)", "prompt_tokens": args.length,
               "rows": rows}
    lines = ["# The compiled `triton_fused` layer step as traced for a GPU (on the CPU), SmolLM2-135M", "",
             f"Command: `{results['command']}`; torch {torch.__version__}, triton {triton.__version__}, Triton's "
             "write analysis against sm_90, fake `meta` tensors, AOT functionalisation keeping input mutations, "
             "then Inductor's re-inplacing pass (no code generation, no kernel run). *writes*: the tensors the "
             "analysis found each launch writes; *copies*: those still copied before the launch after "
             "re-inplacing; *other ops*: graph operations besides the launches, views and allocations; *constants*: "
             "tensors the step makes from host data (a copy to the device per call); "
             "*fallbacks*: times the analysis could not read a launch and took every tensor argument as written (it "
             "runs in Dynamo and again in functionalisation).", "",
             table(["configuration", "launches", "copies", "other ops", "constants", "fallbacks", "traced"],
                   [[name, " → ".join(launch["kernel"] for launch in row["launches"]),
                     sum(len(launch["copies"]) for launch in row["launches"]), row["ops"] or "none", row["constants"],
                     len(row["analysis_fallbacks"]), "yes" if row["error"] is None else row["error"]]
                    for name, row in rows.items()]), "", "Tensors each launch writes:", ""]
    for name, row in rows.items():
        writes = "; ".join(f"`{launch['kernel']}` {', '.join(launch['writes'])}" for launch in row["launches"])
        lines.append(f"- **{name}**: {writes}")
    paths = write_results(args.out, "compile-trace-cpu", results, "\n".join(lines) + "\n")
    print(paths[1].read_text())
    return paths[1]


if __name__ == "__main__":
    main()
