"""Device operations per decode step, counted on the CPU: what a GPU would launch, configuration by configuration.

    python benchmarks/dispatch_count.py                  # SmolLM2, a 512-token pass-key prompt, stored moments
    python benchmarks/dispatch_count.py --length 256 --out /tmp/count

Each configuration prefills the embedded model once, decodes one step, then counts the next one: every torch
operation dispatched (those that only make a view or allocate excluded: they launch nothing) and every Triton
launch (the ``triton`` executors run in Triton's interpreter here, so this needs triton and numpy). On a GPU each
counted operation is at least one kernel when run eagerly; compiled, Inductor fuses torch operations (never
Triton launches), so for the torch part the count is an upper bound. The number that matters is ``extra per
layer``: the step's operations beyond the unwrapped model's (transformers' SDPA), over the model's layers; the
real kernel counts are the GPU suite's (``benchmarks/run.py --gpu``), which this does not replace.

Writes ``<out>/dispatch-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LEAN = {"name": "qada_tail", "tau": 0.3, "attend_exact": True, "super_page": 16, "super_pages": 4, "pages": 4,
        "heavy": 16, "scale_exact": 8192, "shrink_exact": False}
"""The accurate read-lean configuration (``qada.criteria.READ_LEAN`` with ``attend_exact``); spelled out here so that
importing this module does not import torch (``tests/test_benchmarks.py`` checks it equals ``READ_LEAN``'s)."""

CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]] | None] = {  # name: (criterion, executor) or dense
    "dense (transformers sdpa)": None,
    "dense criterion, sdpa": ("dense", {"name": "sdpa"}),  # qada's all-dense path on the CPU: the executor alone
    "dense criterion, triton": ("dense", {"name": "triton"}),  # qada's all-dense path: the executor alone
    "qada, sdpa": ({"name": "qada", "tau": 0.6}, {"name": "sdpa"}),
    "qada, triton": ({"name": "qada", "tau": 0.6}, {"name": "triton"}),
    "qada, triton_fused": ({"name": "qada", "tau": 0.6}, {"name": "triton_fused"}),
    "qada, triton_fused decide_once": ({"name": "qada", "tau": 0.6}, {"name": "triton_fused", "decide_once": True}),
    "qada_budget, triton": ({"name": "qada_budget", "sparsity": 0.85}, {"name": "triton"}),
    "qada_budget, triton_fused": ({"name": "qada_budget", "sparsity": 0.85}, {"name": "triton_fused"}),
    "qada_tail, triton": ({"name": "qada_tail", "tau": 0.3}, {"name": "triton"}),
    "qada_tail, triton_fused": ({"name": "qada_tail", "tau": 0.3}, {"name": "triton_fused"}),
    "qada_tail_budget, triton": ({"name": "qada_tail_budget", "sparsity": 0.85}, {"name": "triton"}),
    "qada_tail_budget, triton_fused": ({"name": "qada_tail_budget", "sparsity": 0.85}, {"name": "triton_fused"}),
    "qada_tail+E/lean, triton": (LEAN, {"name": "triton"}),
    "qada_tail+E/lean, triton_fused": (LEAN, {"name": "triton_fused"}),
}


def count_step(model: Any, run: Any, ids: Any, extra: int) -> dict[str, Any]:
    """Prefill ``ids [1, T]`` into a fresh static cache (``run`` attached, or the unwrapped model), decode one step,
    count the next: ``{"ops", "launches", "device_ops", "by_op"}``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks.common import greedy_decode
    from qada.attention import _triton_kernel
    from qada.models import attach

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.inside_launch = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if not self.inside_launch and not (func.is_view or name in NO_KERNEL):
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()
    launches: collections.Counter = collections.Counter()
    original = _triton_kernel.run

    def counted(kernel, grid, *args, **kwargs):
        launches[kernel.fn.__name__] += 1
        counter.inside_launch = True  # the interpreter's own host copies are not the step's work
        try:
            original(kernel, grid, *args, **kwargs)
        finally:
            counter.inside_launch = False

    def second_step_counted(step: int) -> contextlib.AbstractContextManager:
        launches.clear()
        return counter if step == 1 else contextlib.nullcontext()

    if run is not None:
        attach(model, run)
    _triton_kernel.run = counted
    try:
        greedy_decode(model, ids, 2, ids.shape[1] + extra, second_step_counted)
    finally:
        _triton_kernel.run = original
        if run is not None:
            run.remove()
    ops = sum(counter.ops.values())
    n_launches = sum(launches.values())
    return {"ops": ops, "launches": n_launches, "device_ops": ops + n_launches, "by_op": dict(counter.ops),
            "by_launch": dict(launches)}


NO_KERNEL = {"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.lift_fresh", "aten.detach",
             "aten.alias", "aten._local_scalar_dense"}  # fmt: skip
"""Operations that launch nothing on a GPU (allocations, aliases; a scalar read is a host sync, counted apart)."""


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=512, help="prompt length in tokens")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the executors' kernels on the CPU
    os.environ["QADA_COMPILE"] = "0"  # the interpreter cannot be compiled: eager steps, every operation visible

    import torch

    from benchmarks.common import machine_info, table, write_results
    from qada.eval.passkey import passkey_prompt
    from qada.models import build_run, load_default_model, prepare_run

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model, tokenizer = load_default_model()
    ids = passkey_prompt(tokenizer, length=args.length, depth=0.5).input_ids
    layers = model.config.num_hidden_layers
    rows = {}
    for name, config in CONFIGS.items():
        run = None
        if config is not None:
            criterion, executor = config
            run = prepare_run(build_run(criterion=criterion, moments="stored", executor=executor), model, tokenizer)
        rows[name] = count_step(model, run, ids, extra=8)
        print(f"{name}: {rows[name]['device_ops']} device operations per step", flush=True)
    dense = rows["dense (transformers sdpa)"]["device_ops"]
    for row in rows.values():
        row["extra_per_layer"] = (row["device_ops"] - dense) / layers
    info = machine_info("cpu")
    results = {"command": f"python benchmarks/dispatch_count.py --length {args.length}", "machine": info,
               "model": "SmolLM2-135M (embedded)", "layers": layers, "prompt_tokens": args.length,
               "moments": "stored", "rows": rows}
    lines = [f"# Device operations per decode step (counted on the CPU), SmolLM2-135M, {layers} layers",
             "", f"Command: `{results['command']}`; torch {torch.__version__}, stored moments, a static cache, eager "
             "steps (the `triton` executors in Triton's interpreter). A *device operation* is a torch operation that "
             "is not a view or an allocation, or a Triton launch: on a GPU, at least one kernel each when eager. "
             "The GPU suite counts the real kernels.", "",
             table(["configuration", "torch ops", "Triton launches", "device ops / step", "extra per layer"],
                   [[name, r["ops"], r["launches"], r["device_ops"], f"{r['extra_per_layer']:.1f}"]
                    for name, r in rows.items()]), ""]
    base = collections.Counter(rows["dense (transformers sdpa)"]["by_op"])
    for name, row in rows.items():
        if name.startswith("dense"):
            continue
        more = collections.Counter(row["by_op"]) - base
        fewer = base - collections.Counter(row["by_op"])
        lines.append(f"- **{name}**: launches {row['by_launch'] or '{}'}; torch ops beyond dense "
                     f"{dict(more.most_common(8))}" + (f", fewer {dict(fewer)}" if fewer else ""))
    paths = write_results(args.out, "dispatch-cpu", results, "\n".join(lines) + "\n")
    print(paths[1].read_text())
    return paths[1]


if __name__ == "__main__":
    main()
