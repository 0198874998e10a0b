"""Decode steps of a few configurations interleaved one by one in one process: an A/B on a noisy host.

Each configuration gets its own copy of the embedded model, its own static cache (filled from one shared prefill
of a pass-key prompt) and its own run; after ``warmup`` steps each, the configurations take turns, one decode step
at a time (the order reversed every other round), so that a drift of the host's speed (its memory bandwidth moved
between 11 and 25 GB/s from one hour to the next on the 2-core machines) hits all alike. Reported: each
configuration's median step time and the median over rounds of its step time over the first configuration's in the
same round.

The order the copies are built in matters on its own: three copies of one configuration (``dense packed compiled``,
``... #2``, ``... #3``: a ``#`` tag names a replica) stepped at 1.000, 0.965 and 0.931 of the first one's time in one
run on a 2-core host (0.972 and 0.924 with a code object of its own per compiled forward, 1.000 and 0.928 eager: not
Dynamo's cache; the cause was not found). So the whole measurement is repeated ``--rotations`` times (default: once
per configuration), the copies built afresh in an order rotated by one each time, so that each configuration is
built in each position; the ratios are the median over the rounds of every rotation, and each rotation's own is
reported too.

Configurations: ``dense`` (the unwrapped model, transformers' own attention), ``dense packed`` (the unwrapped model,
packed grouped-query attention) or a criterion (``qada dense``: the ``dense`` criterion, qada's all-dense path;
``qada``, ``qada_tail``, ``qada_tail_budget``, with the suite's tau / sparsity and stored moments;
``qada_tail+E/lean`` and ``qada_tail_budget+E/lean/group``, the read-lean settings of the RULER tables,
``qada.criteria.READ_LEAN``), then modifiers:
``compiled`` (``torch.compile(model.forward, fullgraph=True)``), ``no small-matmul pass`` (the layer step
compiled without :class:`~qada.models.small_matmul.SmallMatmulPass`, to measure what it gains) and ``no
ahead-of-time`` (the layer step through ``torch.compile`` rather than compiled ahead of time,
:mod:`qada.models.ahead_step`), ``own window`` (the ``sdpa`` executor attends over the window itself, not taking
the layer step's window attention: ``step_window=False``). Several model copies
share the caches of the CPU, so absolute times run higher than with one model: compare the ratios.

    python benchmarks/interleaved.py --length 7680 --steps 80 \
        --configs "dense packed compiled,qada_tail compiled no small-matmul pass,qada_tail compiled"
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.end_to_end import Stepper, fresh_cache
from benchmarks.packed_dense import packed_attention
from qada.criteria import READ_LEAN
from qada.eval.decode import prefill, prefill_from_cache
from qada.eval.passkey import passkey_prompt
from qada.models import attach, build_run, load_default_model, prepare_run

__all__ = ["CRITERIA", "parse_config", "run_interleaved"]

CRITERIA = {
    "qada dense": {"name": "dense"},
    "qada": {"name": "qada", "tau": 0.6},
    "qada_tail": {"name": "qada_tail", "tau": 0.3},
    "qada_tail_budget": {"name": "qada_tail_budget", "sparsity": 0.85},
    "qada_tail+E/lean": {"name": "qada_tail", "tau": 0.3, "attend_exact": True, **READ_LEAN},
    "qada_tail_budget+E/lean/group": {"name": "qada_tail_budget", "sparsity": 0.85, "attend_exact": True,
                                      "per_group": True, **READ_LEAN},
}
NO_PASS = "no small-matmul pass"
NO_AHEAD = "no ahead-of-time"
OWN_WINDOW = "own window"


def parse_config(name: str) -> dict[str, Any]:
    """``"qada_tail compiled no small-matmul pass"`` -> ``{"criterion": ..., "compiled": True, "small_matmul":
    False, "ahead": True, "step_window": True}``; ``criterion`` is ``None`` for the unwrapped model (``dense``,
    ``dense packed``; ``packed`` says which). The modifiers after
    the criterion, in any order: ``compiled``, :data:`NO_PASS`, :data:`NO_AHEAD` (the layer step through
    ``torch.compile`` instead of :mod:`qada.models.ahead_step`), :data:`OWN_WINDOW` (the executor attends over the
    window itself)."""
    rest = name.split(" #")[0].strip()  # "... #2": a replica of the same configuration (its own model copy)
    flags = {"compiled": False, NO_PASS: False, NO_AHEAD: False, OWN_WINDOW: False}
    found = True
    while found:
        found = False
        for flag in flags:
            if rest.endswith(flag) and not flags[flag]:
                flags[flag], rest, found = True, rest.removesuffix(flag).strip(), True
    config = {"compiled": flags["compiled"], "small_matmul": not flags[NO_PASS], "ahead": not flags[NO_AHEAD],
              "step_window": not flags[OWN_WINDOW]}
    if rest in ("dense", "dense packed"):
        if flags[NO_PASS] or flags[NO_AHEAD] or flags[OWN_WINDOW]:
            raise ValueError(f"{name!r}: the dense model has no layer step to compile otherwise")
        return {"criterion": None, "packed": rest == "dense packed", **config}
    if rest not in CRITERIA:
        raise ValueError(f"unknown configuration {name!r}: expected 'dense', 'dense packed' or one of "
                         f"{sorted(CRITERIA)}, then 'compiled', '{NO_PASS}', '{NO_AHEAD}' and/or '{OWN_WINDOW}'")
    return {"criterion": CRITERIA[rest], **config}


@contextlib.contextmanager
def _without_small_matmul_pass():
    """The layer step compiled inside this block has no small-matmul pass (a no-op pass with its own cache key)."""
    from qada.models import small_matmul

    cls = small_matmul.SmallMatmulPass
    saved = cls.__call__, cls.uuid
    cls.__call__ = lambda self, graph: None
    cls.uuid = lambda self: b"qada-benchmark-no-small-matmul-pass"
    try:
        yield
    finally:
        cls.__call__, cls.uuid = saved


def run_interleaved(configs: list[str], length: int, steps: int, warmup: int = 3, rotations: int = 1,
                    log=print) -> dict[str, Any]:
    """Each configuration on its own model copy, ``warmup`` steps each, then ``steps`` rounds of one step each; all
    of it ``rotations`` times, the copies built afresh in the order rotated by one each time (rotation ``r`` builds
    ``configs[r:] + configs[:r]``), so that each configuration is built in each position."""
    parsed = [parse_config(name) for name in configs]
    base_model, tokenizer = load_default_model()
    prompt = passkey_prompt(tokenizer, length=length, depth=0.5)
    with torch.no_grad():
        done = prefill(base_model, prompt.input_ids, keep_queries=32)
    base = [(layer.keys, layer.values) for layer in done.cache.layers]
    first = done.last_logits.argmax(-1).reshape(1)
    times: dict[str, list[float]] = {name: [] for name in configs}
    per_rotation: list[dict[str, float]] = []
    summaries: dict[str, Any] = {}
    for rotation in range(rotations):
        shift = rotation % len(configs)
        order = configs[shift:] + configs[:shift]
        got, summaries = _interleave(order, dict(zip(configs, parsed, strict=True)), base_model, tokenizer, done, base,
                                     first, length, steps, warmup, log)
        for name in configs:
            times[name] += got[name]
        per_rotation.append({name: statistics.median(_ratios(got, name, configs[0])) for name in configs})
        log(f"  interleaved: rotation {rotation} (built {order}): "
            + ", ".join(f"{name} {ratio:.3f}" for name, ratio in per_rotation[-1].items()))
        gc.collect()
    reference = configs[0]
    rows = []
    for name in configs:
        summary = summaries[name]
        rows.append({"config": name, "median_ms": 1e3 * statistics.median(times[name]),
                     "ratio_to_first": statistics.median(_ratios(times, name, reference)),
                     "ratio_per_rotation": [ratios[name] for ratios in per_rotation],
                     "sparsity": None if summary is None else summary["sparsity"],
                     "kv_read": None if summary is None else summary["kv_read"]})  # fmt: skip
    return {"length": length, "steps": steps, "warmup": warmup, "rotations": rotations, "reference": reference,
            "rows": rows, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip


def _ratios(times: dict[str, list[float]], name: str, reference: str) -> list[float]:
    """``name``'s step time over ``reference``'s, round by round."""
    return [t / r for t, r in zip(times[name], times[reference], strict=True)]


def _interleave(order: list[str], parsed: dict[str, dict[str, Any]], base_model: Any, tokenizer: Any, done: Any,
                base: list, first: torch.Tensor, length: int, steps: int, warmup: int, log
                ) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """One rotation: the copies built in ``order``, warmed up, then ``steps`` rounds (the order reversed every other
    round) -> (step seconds per configuration, run summaries)."""
    steppers, runs = {}, {}
    with contextlib.ExitStack() as stack, torch.no_grad():
        for name in order:
            config = parsed[name]
            model = copy.deepcopy(base_model)
            cache = fresh_cache(model, base, "static", length + warmup + steps + 8, 1)
            run = None
            if config["criterion"] is None:
                if config["packed"]:
                    stack.enter_context(packed_attention(model))
            else:
                executor = {"name": "sdpa", "step_window": config["step_window"]}
                run = prepare_run(build_run(criterion=config["criterion"], moments="stored", executor=executor), model,
                                  tokenizer)
                if not config["ahead"]:
                    run.layer_step.ahead = None
                attach(model, run)
                stack.callback(run.remove)
                prefill_from_cache(run, cache, queries=done.queries)
            forward = torch.compile(model.forward, fullgraph=True) if config["compiled"] else None
            stepper = Stepper(model, cache, first, length, forward)
            with contextlib.nullcontext() if config["small_matmul"] else _without_small_matmul_pass():
                for _ in range(warmup):  # (the compilations)
                    stepper()
            steppers[name], runs[name] = stepper, run
            log(f"  interleaved: {name} ready")
        times: dict[str, list[float]] = {name: [] for name in order}
        for round_ in range(steps):
            for name in order if round_ % 2 == 0 else order[::-1]:
                begin = time.perf_counter()
                steppers[name]()
                times[name].append(time.perf_counter() - begin)
        summaries = {name: (run.summary() if run is not None else None) for name, run in runs.items()}
    torch._dynamo.reset()  # the compiled graphs hold the copies: let them go with the rotation
    return times, summaries


def to_markdown(result: dict[str, Any], command: str) -> str:
    lines = [f"# Interleaved decode steps, SmolLM2-135M at {result['length']} tokens (CPU)", "",
             f"Command: `{command}`; torch {result['torch']}, {result['threads']} threads, load average "
             f"{tuple(round(x, 2) for x in result['load_average'])}, {result['date']}. {result['steps']} rounds "
             f"of one step per configuration after {result['warmup']} warm-up steps each, "
             f"{result['rotations']} rotation(s) of the order the copies are built in; each configuration on "
             "its own model copy (absolute times run higher than with one model: compare the ratios).", "",
             f"| config | median ms a step | x {result['reference']} (median over rounds) | per rotation | sparsity "
             "| kv_read |", "|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["rows"]:
        sparsity = "" if row["sparsity"] is None else f"{row['sparsity']:.3f}"
        kv_read = "" if row["kv_read"] is None else f"{row['kv_read']:.3f}"
        rotations = " ".join(f"{ratio:.3f}" for ratio in row["ratio_per_rotation"])
        lines.append(f"| {row['config']} | {row['median_ms']:.1f} | {row['ratio_to_first']:.3f} | {rotations} | "
                     f"{sparsity} | {kv_read} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", required=True, help="comma-separated configurations (the first: reference)")
    parser.add_argument("--length", type=int, default=7680)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rotations", type=int, default=None,
                        help="measure this many times, the copies built in an order rotated by one each time "
                             "(default: one per configuration; the copy built last runs fastest on some hosts)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    if len(configs) < 2:
        parser.error("--configs: give at least two configurations to compare")
    if len(set(configs)) < len(configs):
        parser.error("--configs: a configuration twice; tag a replica with '#', e.g. 'qada compiled #2'")
    rotations = args.rotations if args.rotations is not None else len(configs)
    if rotations < 1:
        parser.error("--rotations: give at least 1")
    result = run_interleaved(configs, args.length, args.steps, args.warmup, rotations)
    command = "python benchmarks/interleaved.py " + " ".join(
        f'"{a}"' if " " in a or "," in a else a for a in (argv if argv is not None else sys.argv[1:]))
    text = to_markdown(result, command)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
