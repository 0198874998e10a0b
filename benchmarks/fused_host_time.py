"""Host time of the ``triton_fused`` layer step run eagerly (its default), measured on the CPU with no kernel run.

    python benchmarks/fused_host_time.py                 # SmolLM2, a 256-token pass-key prompt, stored moments
    python benchmarks/fused_host_time.py --repeats 7 --calls 200 --out /tmp/host

By default the ``triton_fused`` executor runs a run's layer step eagerly (``compile_step=False``): the same Triton
launches as a compiled step, but each layer and step spends host time in qada's Python around them. Inside a model
compiled with ``mode="reduce-overhead"`` that time is spent once, while the CUDA graph is recorded, and never at a
replay; without CUDA graphs it is spent at every layer of every step. This script prefills the embedded model with
each configuration, stops at the first decode step's layer step and calls it again and again with Triton's launch
replaced by a no-op that records the kernel's name: the time per call is the Python of the step (argument checks,
allocations, the launch arguments), not Triton's own launcher (a few microseconds per launch on a GPU) nor the
kernels. Median over ``--repeats`` timings of ``--calls`` calls each, with the load average.

Writes ``<out>/fused-host-time-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS: dict[str, dict[str, Any]] = {  # name: build_run arguments (stored moments)
    "qada": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton_fused"}},
    "qada, decide_once": {"criterion": {"name": "qada", "tau": 0.6},
                          "executor": {"name": "triton_fused", "decide_once": True}},
    "qada_tail": {"criterion": {"name": "qada_tail", "tau": 0.3}, "executor": {"name": "triton_fused"}},
    "qada_tail_budget": {"criterion": {"name": "qada_tail_budget", "sparsity": 0.85},
                         "executor": {"name": "triton_fused"}},
}  # fmt: skip


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=256, help="prompt length in tokens")
    parser.add_argument("--calls", type=int, default=200, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings per configuration (the median is reported)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats must be positive")
    os.environ.pop("TRITON_INTERPRET", None)  # the launch arguments as for a GPU (no kernel runs)
    os.environ["QADA_COMPILE"] = "0"

    import torch
    from tqdm import tqdm

    from benchmarks.common import machine_info, measure, table, write_results
    from benchmarks.compile_trace import capture_layer_step, pretend_cuda_triton
    from qada.attention import _triton_kernel
    from qada.eval.passkey import passkey_prompt
    from qada.models import build_run, load_default_model, prepare_run

    pretend_cuda_triton()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model, tokenizer = load_default_model()
    ids = passkey_prompt(tokenizer, length=args.length, depth=0.5).input_ids
    launched: list[str] = []
    _triton_kernel.run = lambda kernel, grid, *a, **k: launched.append(kernel.fn.__name__)
    rows = []
    for name, config in tqdm(CONFIGS.items(), desc="configurations"):
        run = prepare_run(build_run(moments="stored", criterion=config["criterion"], executor=config["executor"]),
                          model, tokenizer)
        step, step_args = capture_layer_step(model, run, ids)
        launched.clear()
        step.eager(*step_args)
        kernels = list(launched)
        timing = measure(lambda step=step, step_args=step_args: step.eager(*step_args), "cpu", reps=args.repeats,
                         warmup=max(1, args.calls // 10), inner=args.calls)
        rows.append({"config": name, "launches": kernels, "seconds_per_call": timing["median"], "min": timing["min"],
                     "max": timing["max"], "times": timing["times"]})
    layers = model.config.num_hidden_layers
    command = "python benchmarks/fused_host_time.py" + ("" if args.length == 256 else f" --length {args.length}")
    results = {"command": command, "machine": machine_info("cpu"), "load_average": os.getloadavg(),
               "length": args.length, "calls": args.calls, "repeats": args.repeats, "layers": layers, "rows": rows}
    lines = ["# Host time of the eager `triton_fused` layer step (CPU, no kernel run), SmolLM2-135M", "",
             f"Command: `{command}`; torch {torch.__version__}; {torch.get_num_threads()} threads; load average "
             f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}. One layer step of the first decode step after a "
             f"{args.length}-token prompt, called {args.calls} times per timing with Triton's launch replaced by a "
             f"no-op; median [min-max] of {args.repeats} timings. *per token*: times the model's {layers} layers, "
             "what a decode step spends in qada's Python without CUDA graphs (inside a CUDA graph: nothing at "
             "replay).", "",
             table(["configuration", "launches", "us per layer step", "ms per token"],
                   [[r["config"], " -> ".join(r["launches"]),
                     f"{r['seconds_per_call'] * 1e6:.0f} [{r['min'] * 1e6:.0f}-{r['max'] * 1e6:.0f}]",
                     f"{r['seconds_per_call'] * layers * 1e3:.2f}"] for r in rows]), ""]
    paths = write_results(args.out, "fused-host-time-cpu", results, "\n".join(lines))
    print(paths[1].read_text())
    return paths[1]


if __name__ == "__main__":
    main()
