"""The ahead-of-time layer step's package alone, warm and after what a decode step does between two layers.

Inside a compiled decode step of ``qada_tail+E/lean`` (SmolLM2 at 7.68k, 2 threads) one layer's package
(:class:`~qada.models.ahead_step.AheadOfTimeStep`'s ``runner.run``) takes ~540 us a call; called in a loop on the same
inputs it takes ~240 us. This script measures where the difference comes from: one layer's real inputs are taken from
a decode step, then the package is timed after each of

* ``nothing``: back to back (warm caches, the OpenMP worker spinning);
* ``sum 32 MB``: a sum over 32 MB (every cache level evicted, the worker busy);
* ``gemv 14 MB``: a matrix-vector product the size of an MLP projection (what the model runs between layers);
* ``sleep 1 ms``: both threads idle (caches kept, the worker left to wait);
* ``busy N us``: the main thread spinning in Python for ``N`` us, the worker idle (the Python between two layers).

    python benchmarks/package_cold.py --length 7680 --calls 300 --out benchmarks/results

Writes ``<out>/package-cold-cpu.{json,md}``: per case the median call in microseconds and its ratio to ``nothing``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

__all__ = ["capture_layer_call", "make_cases", "spin", "time_after"]

BUSY_US = (20, 100, 300, 1000, 3000)


def spin(microseconds: float) -> None:
    """Keep the calling thread busy for ``microseconds`` (no sleep: the OpenMP worker waits, the main thread runs)."""
    end = time.perf_counter_ns() + int(microseconds * 1e3)
    while time.perf_counter_ns() < end:
        pass


def make_cases() -> dict[str, Callable[[], Any]]:
    """The cases' names -> what runs before each timed call."""
    big = torch.randn(8 << 20)  # 32 MB
    weight, vector = torch.randn(576, 6144), torch.randn(6144)  # ~14 MB
    cases: dict[str, Callable[[], Any]] = {"nothing": lambda: None, "sum 32 MB": big.sum,
                                           "gemv 14 MB": lambda: torch.mv(weight, vector),
                                           "sleep 1 ms": lambda: time.sleep(1e-3)}
    for microseconds in BUSY_US:
        cases[f"busy {microseconds} us"] = lambda us=microseconds: spin(us)
    return cases


def time_after(before: Callable[[], Any], call: Callable[[], Any], calls: int) -> float:
    """The median time of ``call()`` in microseconds, each call right after ``before()``."""
    times = []
    for _ in range(calls):
        before()
        begin = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - begin)
    return statistics.median(times) / 1e3


def capture_layer_call(length: int, criterion: dict[str, Any], steps: int = 3) -> tuple[Any, list[torch.Tensor]]:
    """A compiled decode of the embedded model on a pass-key prompt of ``length`` tokens (stored moments, the ``sdpa``
    executor) for ``steps`` steps -> the last layer call's ``(runner, leaves)``: its package and its input tensors."""
    from benchmarks.end_to_end import Stepper, fresh_cache
    from qada.eval.decode import prefill, prefill_from_cache
    from qada.eval.passkey import passkey_prompt
    from qada.models import attach, build_run, load_default_model, prepare_run
    from qada.models.ahead_step import flatten_arguments

    model, tokenizer = load_default_model()
    prompt = passkey_prompt(tokenizer, length=length, depth=0.5)
    with torch.no_grad():
        done = prefill(model, prompt.input_ids, keep_queries=32)
        base = [(layer.keys, layer.values) for layer in done.cache.layers]
        cache = fresh_cache(model, base, "static", length + steps + 8, 1)
        run = prepare_run(build_run(criterion=criterion, moments="stored", executor={"name": "sdpa"}), model,
                          tokenizer)
        attach(model, run)
        prefill_from_cache(run, cache, queries=done.queries)
        ahead = run.layer_step.ahead
        if ahead is None:
            raise RuntimeError("this run has no ahead-of-time layer step (is compilation off, or not the CPU?)")
        seen: dict[str, Any] = {}
        call = type(ahead).__call__

        def recording(self: Any, args: tuple) -> Any:
            seen["args"] = args
            return call(self, args)

        stepper = Stepper(model, cache, done.last_logits.argmax(-1).reshape(1), length,
                          torch.compile(model.forward, fullgraph=True))
        type(ahead).__call__ = recording
        try:
            for _ in range(steps):
                stepper()
        finally:
            type(ahead).__call__ = call
        if len(ahead.entries) != 1:  # one run, one configuration, one cache size: one package or none
            raise RuntimeError(f"expected one compiled package but got {len(ahead.entries)} (declined: "
                               f"{ahead.declined})")
        runner, _, _ = next(iter(ahead.entries.values()))
        leaves, _ = flatten_arguments(seen["args"])
        return runner, leaves


def to_markdown(result: dict[str, Any], command: str) -> str:
    """The table of :func:`main`'s result."""
    lines = [f"# The layer step's package, warm and cold (CPU, T={result['length']})", "",
             f"Command: `{command}`; {result['cpu']}, {result['threads']} threads, torch {result['torch']}, load "
             f"average {tuple(round(x, 2) for x in result['load_average'])}, {result['calls']} calls a case.", "",
             "| before each call | median call (us) | ratio to back to back |", "|---|---|---|"]
    reference = result["cases"]["nothing"]
    for name, microseconds in result["cases"].items():
        lines.append(f"| {name} | {microseconds:.1f} | {microseconds / reference:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.common import machine_info
    from benchmarks.interleaved import CRITERIA

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=7680, help="prompt length in tokens")
    parser.add_argument("--config", default="qada_tail+E/lean", choices=sorted(CRITERIA), help="the criterion")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per case")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (at most the cores)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.calls < 1 or args.length < 64 or args.threads < 1:
        parser.error("--calls and --threads must be >= 1 and --length >= 64")
    torch.set_num_threads(args.threads)
    runner, leaves = capture_layer_call(args.length, CRITERIA[args.config])
    with torch.no_grad():
        for _ in range(20):  # warm up
            runner.run(leaves)
        cases = {name: time_after(before, lambda: runner.run(leaves), args.calls)
                 for name, before in make_cases().items()}
    result = {"length": args.length, "config": args.config, "calls": args.calls, "threads": torch.get_num_threads(),
              "cases": cases, "cpu": machine_info()["cpu"], "torch": torch.__version__,
              "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "package-cold-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    command = "python benchmarks/package_cold.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = to_markdown(result, command.strip())
    (out / "package-cold-cpu.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
