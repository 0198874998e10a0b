"""The bytes each Triton launch of one decode step reads and writes, counted in Triton's interpreter on the CPU.

    python benchmarks/launch_bytes.py                    # SmolLM2 bf16, a 2,048-token pass-key prompt (~40 min)
    python benchmarks/launch_bytes.py --length 512 --configs "qada fused" --out /tmp/bytes

A decode step at long context is bound by the bytes it moves, and sparsity (the share of heads that are local) is
not that number: the criterion reads what it decides from (the window's keys, the moments, the state that updates
them), and a kernel can read the same bytes many times. This script runs each configuration's decode step eagerly
with its kernels in Triton's interpreter and records every element a ``tl.load`` or ``tl.store`` touches (masked-off
lanes excluded), attributed to the launch's tensor arguments. Per launch and argument it reports

* **unique** bytes: the distinct bytes read (written); on a GPU, what comes from (goes to) memory at least once,
  the floor of the DRAM traffic when a kernel re-reads what it read before out of its caches;
* **accessed** bytes: every load (store) counted, re-reads included: what the caches serve.

It compares them with **dense K/V**: the K/V bytes a dense decode reads at the same step (every real token of every
KV head of every layer, once). ``qada dense`` is qada's all-dense Triton path (its overhead beyond the ideal dense
read is the split partials); the others decide with stored moments, as the GPU suite's rows. A mask per element
makes the counts exact for these kernels (they read through pointer tensors; none uses block pointers or TMA).
This counts bytes, not time: the GPU suite (``benchmarks/run.py --gpu``) times them.

Writes ``<out>/launch-bytes-cpu.{json,md}`` (``launch-bytes-cpu-L<length>`` at another ``--length``, ``<name>`` with
``--name``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dispatch_count import LEAN  # noqa: E402  (the accurate read-lean qada_tail configuration)

FROZEN = {"name": "current", "freeze": True}
"""The ``current`` source frozen at the prefill's moments (the paper's setting for short answers): stepped in torch
(no moment step at all), so the estimate is a launch of its own, or the splits' (``estimating``)."""

CONFIGS: dict[str, tuple[Any, Any, dict[str, Any]]] = {  # name: (criterion, moments, executor)
    "qada dense": ("dense", "none", {"name": "triton"}),
    "qada fused": ({"name": "qada", "tau": 0.6}, "stored", {"name": "triton_fused"}),
    "qada fused once": ({"name": "qada", "tau": 0.6}, "stored", {"name": "triton_fused", "decide_once": True}),
    "qada fused estimating": ({"name": "qada", "tau": 0.6}, "stored", {"name": "triton_fused",
                                                                        "estimate_in_splits": True}),
    "qada fused frozen": ({"name": "qada", "tau": 0.6}, FROZEN, {"name": "triton_fused"}),
    "qada fused frozen estimating": ({"name": "qada", "tau": 0.6}, FROZEN, {"name": "triton_fused",
                                                                             "estimate_in_splits": True}),
    "qada_tail fused splits": ({"name": "qada_tail", "tau": 0.3}, "stored",
                               {"name": "triton_fused", "decide_once": False}),
    "qada_tail fused once": ({"name": "qada_tail", "tau": 0.3}, "stored",
                             {"name": "triton_fused", "decide_once": True}),
    "qada_tail fused spread": ({"name": "qada_tail", "tau": 0.3}, "stored",
                               {"name": "triton_fused", "decide_once": True, "pages_per_program": 32}),
    "qada_tail_budget fused": ({"name": "qada_tail_budget", "sparsity": 0.85}, "stored", {"name": "triton_fused"}),
    "qada_tail+E/lean fused": (LEAN, "stored", {"name": "triton_fused"}),
    "qada_tail+E/lean fused once": (LEAN, "stored", {"name": "triton_fused", "decide_once": True}),
}
"""Every configuration whose whole decode step runs in Triton launches (the ``triton`` executor with a criterion
decides in torch operations, which this does not count), decided as the GPU suite's rows of the same names: ``qada_tail
fused splits`` in every split at any length (the executor's default, the suite's ``qada_tail fused``, decides so up to
256 bounded pages, and once above, as from about 4,096 tokens; results before 2026-12-06 name this row ``qada_tail
fused``), ``once`` in a launch before the split, ``spread`` once with every row's page bounds spread over page-top
programs of 32 pages each (the GPU suite's row of that name, :data:`~benchmarks.suites.SPREAD_PAGES`: no torch
import here), the read-lean rows by default (in the splits up to 256 bounded pages, its super-pages and the pages of
its best four). ``estimating``: each split computes its heads' ``log E[exp(s)]`` from the moments
(``estimate_in_splits``); ``frozen``: :data:`FROZEN` moments instead of stored ones."""

KV_ARGS = {"K", "V", "KEYS", "PT_K"}
"""The arguments that are the KV cache in every launch that reads it (``KEYS``: the moment step's, whose launch reads
the step's key, and with ``decide_once`` the window's keys for the decision)."""


class ArgumentSpans:
    """The memory spans ``[start, end)`` of one launch's tensor arguments, to attribute an address to its argument
    (``"Q=SINKS"``: one tensor passed as both). A span is a tensor's extent, from its first to its last element."""

    def __init__(self, names: list[str], tensors: list[Any]) -> None:
        import numpy as np

        found: dict[tuple[int, int], list[str]] = {}
        for name, tensor in zip(names, tensors, strict=True):
            if tensor.numel() == 0:
                continue
            extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
            start = tensor.data_ptr()
            found.setdefault((start, start + extent * tensor.element_size()), []).append(name)
        # one tensor passed as several arguments (a placeholder for one not given) is named after all of them
        spans = sorted((start, end, "=".join(names)) for (start, end), names in found.items())
        self.starts = np.array([s for s, _, _ in spans], dtype=np.uint64)
        self.ends = np.array([e for _, e, _ in spans], dtype=np.uint64)
        self.names = [n for _, _, n in spans]

    def split(self, addresses: Any) -> dict[str, Any]:
        """``addresses [n]`` (uint64) grouped by the argument they fall in (``"?"``: none of them)."""
        import numpy as np

        at = np.searchsorted(self.starts, addresses, side="right") - 1
        inside = (at >= 0) & (addresses < self.ends[np.maximum(at, 0)])
        groups = {}
        for index in np.unique(at[inside]):
            groups[self.names[index]] = addresses[inside & (at == index)]
        if not inside.all():
            groups["?"] = addresses[~inside]
        return groups


class ByteRecorder:
    """While :meth:`recording`, every launch through qada's launcher (in Triton's interpreter) is recorded while
    ``on``: ``launches``, one ``{"kernel", "read": {arg: [address arrays]}, "written": ..., "itemsize": {arg: n},
    "grid": programs, "programs": {"read": {program: bytes}, "written": ..., "loads": {program: n}}}`` each, from the
    interpreter's masked loads and stores (an unmasked one is a masked one with every lane on); ``programs`` counts
    the bytes each program (its ``(x, y, z)`` index) loads and stores, re-reads included, and the loads it executes
    (``tl.load`` calls, each loop iteration's counted)."""

    def __init__(self) -> None:
        self.launches: list[dict[str, Any]] = []
        self.on = True
        self._current: dict[str, Any] | None = None
        self._spans: ArgumentSpans | None = None

    def _record(self, kind: str, ptrs: Any, mask: Any, program: tuple[int, ...]) -> None:
        import numpy as np
        from triton.runtime.interpreter import _get_np_dtype

        if self._current is None:
            return
        addresses = ptrs.data
        if mask is not None:
            addresses = addresses[np.broadcast_to(mask.data, addresses.shape)]
        addresses = np.asarray(addresses, dtype=np.uint64).ravel()
        itemsize = np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize
        self._current["programs"][kind][program] += int(addresses.size) * itemsize
        if kind == "read":
            self._current["programs"]["loads"][program] += 1
        for name, part in self._spans.split(addresses).items():
            self._current[kind].setdefault(name, []).append(part)
            self._current["itemsize"][name] = itemsize

    def _launch(self, original: Any, kernel: Any, grid: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        import torch

        if not self.on:
            return original(kernel, grid, *args, **kwargs)
        bound = dict(zip(kernel.arg_names, args, strict=False)) | kwargs  # (the rest are defaults)
        tensors = {n: t for n, t in bound.items() if isinstance(t, torch.Tensor)}
        self._spans = ArgumentSpans(list(tensors), list(tensors.values()))
        self._current = {"kernel": kernel.fn.__name__, "read": {}, "written": {}, "itemsize": {},
                         "grid": math.prod(int(extent) for extent in grid),  # (qada's launcher: a tuple)
                         "programs": {"read": collections.Counter(), "written": collections.Counter(),
                                      "loads": collections.Counter()}}
        try:
            return original(kernel, grid, *args, **kwargs)
        finally:
            self.launches.append(self._current)
            self._current = None

    @contextlib.contextmanager
    def recording(self):
        """Patch qada's launcher and the interpreter's masked load and store while entered (needs
        ``TRITON_INTERPRET=1`` before triton was first imported)."""
        from triton.runtime.interpreter import InterpreterBuilder

        from qada.attention import _triton_kernel

        if not _triton_kernel.INTERPRETED:
            raise RuntimeError("counting bytes needs the kernels interpreted: set TRITON_INTERPRET=1 before importing")
        load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
        launcher = _triton_kernel.run
        recorder = self

        # (the arguments after the mask differ between Triton versions: cache and eviction policies)
        def masked_load(self, ptrs, mask, *rest):  # noqa: ANN001, ANN202
            recorder._record("read", ptrs, mask, self.grid_idx)
            return load(self, ptrs, mask, *rest)

        def masked_store(self, ptrs, value, mask, *rest):  # noqa: ANN001, ANN202
            recorder._record("written", ptrs, mask, self.grid_idx)
            return store(self, ptrs, value, mask, *rest)

        def launch(kernel, grid, *args, **kwargs):  # noqa: ANN001, ANN202
            return recorder._launch(launcher, kernel, grid, args, kwargs)

        InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = masked_load, masked_store
        _triton_kernel.run = launch
        try:
            yield self
        finally:
            InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = load, store
            _triton_kernel.run = launcher


def heaviest_program(launch: dict[str, Any]) -> int:
    """The bytes the busiest program of one recorded ``launch`` loads and stores (re-reads included): one program runs
    on one SM, so the launch lasts at least the time one SM takes to move them, however many SMs the GPU has."""
    moved = launch["programs"]["read"] + launch["programs"]["written"]
    return max(moved.values(), default=0)


def most_loads(launch: dict[str, Any]) -> int:
    """The ``tl.load`` calls the program of one recorded ``launch`` that executes the most of them executes: each is
    a round of memory requests its warps issue (a GPU overlaps the independent ones; a load whose address or mask
    needs an earlier load's value waits a memory latency for it), so at batch size 1, where a launch has few
    programs, its length in loads rather than in bytes sets its time."""
    return max(launch["programs"]["loads"].values(), default=0)


def summarise(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kernel and argument: unique and accessed bytes read and written over all ``launches`` of one step (a
    kernel's launches in different layers touch different tensors, so their unique bytes add up); per kernel also
    ``programs`` (the largest grid of its launches), ``heaviest`` (the most bytes one program of a launch moves,
    :func:`heaviest_program`, over its launches), ``serial`` (each launch's heaviest program, summed: the bytes
    one SM must move in turn, launch after launch, whatever the others do), ``loads`` and ``serial_loads`` (the same
    for the loads a program executes, :func:`most_loads`)."""
    import numpy as np

    kernels: dict[str, dict[str, Any]] = {}
    for launch in launches:
        entry = kernels.setdefault(launch["kernel"], {"launches": 0, "read": {}, "written": {}, "programs": 0,
                                                      "heaviest": 0, "serial": 0, "loads": 0,
                                                      "serial_loads": 0})
        entry["launches"] += 1
        entry["programs"] = max(entry["programs"], launch["grid"])
        heaviest = heaviest_program(launch)
        entry["heaviest"] = max(entry["heaviest"], heaviest)
        entry["serial"] += heaviest
        loads = most_loads(launch)
        entry["loads"] = max(entry["loads"], loads)
        entry["serial_loads"] += loads
        for kind in ("read", "written"):
            for name, parts in launch[kind].items():
                size = launch["itemsize"][name]
                everything = np.concatenate(parts)
                counts = entry[kind].setdefault(name, {"unique": 0, "accessed": 0})
                counts["unique"] += int(np.unique(everything).size) * size
                counts["accessed"] += int(everything.size) * size
    return kernels


def totals(kernels: dict[str, Any]) -> dict[str, int]:
    """Bytes of one step over every kernel: ``read_unique``, ``read_accessed``, ``kv_unique`` (the KV cache read),
    ``other_read_unique`` (everything else read), ``written_unique``, ``written_accessed``, ``serial`` (each launch's
    heaviest program, summed over the step's launches), ``serial_loads`` (the loads of each launch's longest
    program, summed: see :func:`summarise`)."""
    out = collections.Counter()
    for entry in kernels.values():
        for key in ("serial", "serial_loads"):
            if entry.get(key):
                out[key] += entry[key]
        for name, counts in entry["read"].items():
            out["read_unique"] += counts["unique"]
            out["read_accessed"] += counts["accessed"]
            is_kv = set(name.split("=")) <= KV_ARGS  # (a placeholder passed as KEYS is another tensor)
            out["kv_unique" if is_kv else "other_read_unique"] += counts["unique"]
        for counts in entry["written"].values():
            out["written_unique"] += counts["unique"]
            out["written_accessed"] += counts["accessed"]
    return dict(out)


def count_step(model: Any, run: Any, ids: Any) -> dict[str, Any]:
    """Prefill ``ids [1, T]`` into a static cache with ``run`` attached, decode one step, record the next one's
    launches: ``{"kernels": summarise(...), "totals": totals(...), "launches": n, "sparsity", "kv_sparsity"}`` (the
    last two: ``run.summary()``'s, over both decode steps)."""
    from benchmarks.common import greedy_decode
    from qada.models import attach

    recorder = ByteRecorder()
    recorder.on = False  # (the prefill and the first step are not recorded)

    def second_step_only(step: int) -> contextlib.AbstractContextManager:
        recorder.on = step == 1
        return contextlib.nullcontext()

    attach(model, run)
    try:
        with recorder.recording():
            greedy_decode(model, ids, 2, ids.shape[1] + 4, second_step_only)
        summary = run.summary()
    finally:
        run.remove()
    kernels = summarise(recorder.launches)
    return {"kernels": kernels, "totals": totals(kernels), "launches": len(recorder.launches),
            "sparsity": summary.get("sparsity"), "kv_sparsity": summary.get("kv_sparsity")}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def _ratio(value: float, over: float) -> str:
    return f"{value / over:.2f}" if over else "n/a"


def report(results: dict[str, Any]) -> str:
    """The markdown report of :func:`main`'s results."""
    from benchmarks.common import table

    dense = results["dense_kv_bytes"]
    dense_totals = results["rows"].get("qada dense", {}).get("totals", {})
    dense_serial, dense_loads = dense_totals.get("serial", 0), dense_totals.get("serial_loads", 0)
    lines = [f"# Bytes per decode step, counted in Triton's interpreter: {results['model']}, "
             f"{results['layers']} layers",
             "", f"Command: `{results['command']}`; torch {results['machine']['torch']}, triton "
             f"{results['triton']}, stored moments (rows named `frozen`: the prompt's own, frozen at the prefill), a "
             "static cache, the second decode step after a "
             f"{results['prompt_tokens']:,}-token pass-key prompt, split grids sized for {results['sms']} SMs (an "
             "H100's or H200's count). *unique*: distinct bytes (the floor of the "
             "memory traffic on a GPU) of each kernel over its launches, summed over the step's kernels (a byte "
             "that two kernels read, such as a window key read by a decision launch and by the split, counts "
             "twice: a GPU may serve the second read from L2); *accessed*: every load counted, re-reads included "
             f"(what caches serve); *dense K/V*: the K/V bytes a dense step reads, **{_mb(dense)} MB** here. *K/V "
             "unique*: the cache, so counted; *other read* everything else (moments, moment state, decision "
             "inputs, split partials). kv_sparsity: the run's share of KV-group bulks skipped. *serial*: the "
             "bytes (read and written, re-reads included) of each launch's busiest program, summed over the step's "
             "launches: one program runs on one SM, so a step takes at least the time one SM needs to move them "
             "(at batch size 1 a launch of few programs is bound by it, not by the whole GPU's bandwidth); "
             "*/ dense serial*: over the same sum of the all-dense path (`qada dense`) where it was counted. "
             "*serial loads*: the `tl.load` calls of each launch's longest program (each loop iteration's counted), "
             "summed over the launches: each is a round of memory requests, a memory latency where it needs an "
             "earlier load's value (a GPU overlaps independent ones, and pipelines a loop's), so the length of the "
             "step's chain of programs rather than its bytes.", "",
             table(["configuration", "launches", "kv_sparsity", "read unique MB", "/ dense K/V", "K/V unique MB",
                    "other read unique MB", "read accessed MB", "accessed / unique", "written unique MB",
                    "serial MB", "/ dense serial", "serial loads", "/ dense"],
                   [[name, row["launches"], "n/a" if row["kv_sparsity"] is None else f"{row['kv_sparsity']:.3f}",
                     _mb(row["totals"].get("read_unique", 0)), f"{row['totals'].get('read_unique', 0) / dense:.3f}",
                     _mb(row["totals"].get("kv_unique", 0)), _mb(row["totals"].get("other_read_unique", 0)),
                     _mb(row["totals"].get("read_accessed", 0)),
                     f"{row['totals'].get('read_accessed', 0) / max(row['totals'].get('read_unique', 0), 1):.2f}",
                     _mb(row["totals"].get("written_unique", 0)), _mb(row["totals"].get("serial", 0)),
                     _ratio(row["totals"].get("serial", 0), dense_serial), row["totals"].get("serial_loads", 0),
                     _ratio(row["totals"].get("serial_loads", 0), dense_loads)]
                    for name, row in results["rows"].items()]), "",
             "Per kernel (all layers of the step): its programs a launch (the largest grid), the MB its busiest "
             "program moves and the loads its longest executes (the largest over its launches); MB read unique / "
             "accessed per argument, then written unique.", ""]
    for name, row in results["rows"].items():
        lines.append(f"- **{name}**")
        for kernel, entry in row["kernels"].items():
            reads = ", ".join(f"{arg} {_mb(c['unique'])}/{_mb(c['accessed'])}" for arg, c in
                              sorted(entry["read"].items(), key=lambda item: -item[1]["accessed"]))
            writes = ", ".join(f"{arg} {_mb(c['unique'])}" for arg, c in
                               sorted(entry["written"].items(), key=lambda item: -item[1]["unique"]))
            busiest = (f"{entry.get('programs', 0)} programs, busiest {_mb(entry.get('heaviest', 0))} MB, longest "
                       f"{entry.get('loads', 0)} loads")
            lines.append(f"  - `{kernel}` x{entry['launches']} ({busiest}): read {reads or 'nothing'}; wrote "
                         f"{writes or 'nothing'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048, help="prompt length in tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    parser.add_argument("--sms", type=int, default=132,
                        help="SMs the executors size their split grid for (an H100 or H200 has 132; the "
                        "interpreter's own count is 1)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default=None,
                        help="the results' file name, without its suffix (default: launch-bytes-cpu, "
                        "launch-bytes-cpu-L<length> at another --length)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the executors' kernels on the CPU
    os.environ["QADA_COMPILE"] = "0"  # the interpreter cannot be compiled: eager steps
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")

    import torch
    import triton

    from benchmarks.common import machine_info, write_results
    from benchmarks.end_to_end import kv_bytes_per_token
    from qada.attention import triton_decode
    from qada.eval.passkey import passkey_prompt
    from qada.models import build_run, load_default_model, prepare_run

    triton_decode._num_sms = lambda device: args.sms  # the grid a GPU launches: its splits re-read what they decide
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_default_model(dtype=dtype)
    ids = passkey_prompt(tokenizer, length=args.length, depth=0.5).input_ids
    tokens = ids.shape[1] + 2  # the recorded step's keys: the prompt, the first decoded token and its own
    rows = {}
    for name in names:
        criterion, moments, executor = CONFIGS[name]
        run = prepare_run(build_run(criterion=criterion, moments=moments, executor=executor), model, tokenizer)
        rows[name] = count_step(model, run, ids)
        print(f"{name}: {rows[name]['launches']} launches, {_mb(rows[name]['totals'].get('read_unique', 0))} MB "
              "read (unique)", flush=True)
    given = [flag for flag in ("length", "dtype", "sms", "configs", "name")
             if getattr(args, flag) != parser.get_default(flag)]
    flags = "".join(f" --{flag} {shlex.quote(str(getattr(args, flag)))}" for flag in given)
    results = {"command": f"python benchmarks/launch_bytes.py{flags}", "sms": args.sms,
               "machine": machine_info("cpu"), "triton": triton.__version__,
               "model": f"SmolLM2-135M (embedded, {args.dtype})", "layers": model.config.num_hidden_layers,
               "prompt_tokens": int(ids.shape[1]), "dense_kv_bytes": tokens * kv_bytes_per_token(model),
               "rows": rows}
    name = args.name or "launch-bytes-cpu" + ("" if args.length == parser.get_default("length") else f"-L{args.length}")
    paths = write_results(args.out, name, results, report(results))
    print(paths[1].read_text())
    return paths[1]


if __name__ == "__main__":
    main()
