"""End-to-end greedy decoding: dense (the unwrapped model) vs QAdA vs forced sparsity, eager and compiled, from one
shared prefill.

For each (context length ``T``, batch size ``B``) the prompt is prefilled once (the embedded model: ``B`` real
pass-key prompts; random-weight models and SmolLM2's long "timing only" case: random K/V). Every (configuration,
repetition) then decodes from a cache holding the same K/V — the preallocated ``StaticCache`` of the case, refilled
in place (the default), or a fresh ``DynamicCache`` that grows by ``torch.cat`` — and times every decode step on its
own: ``warmup`` untimed steps first (the first step: moment set-up, lazy allocations, compilation; on a GPU also the
CUDA-graph recording), then the median of the timed ones is the steady per-step time. Input ids and positions stay
on the device (no host read inside a step; the tokens are read after the timing). Configurations alternate inside
each repetition so that drifting machine load hits all alike.

``<name> compiled`` rows decode through ``torch.compile(model.forward, fullgraph=True)`` after an eager prefill,
``mode="reduce-overhead"`` (CUDA graphs) on a GPU; each case compiles afresh (``torch._dynamo.reset()``). The
graph compiled (and recorded) in the first repetition serves the later ones: the static cache is refilled in place
and qada rewrites its buffer state in place at each prefill, so a replay reads and writes the live tensors — the
agreement with the eager twin, over every repetition, checks it.

Each row also gives the byte ceiling: weights + the K/V an ideal kernel reads, over the measured copy bandwidth,
and the fraction of it reached; and (CUDA only) kernels and host syncs per decode step (:func:`count_step_events`).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import Timing, device_sync
from benchmarks.packed_dense import packed_attention
from qada.criteria import StaticCriterion
from qada.eval.decode import prefill_from_cache
from qada.models import attach, build_run, prepare_run
from qada.models.prompt_queries import PromptQueries

__all__ = ["CUDA_ONLY", "DecodeConfig", "Stepper", "byte_ceiling", "count_step_events", "group_static_mask",
           "kernel_diff", "kernel_times", "run_end_to_end", "summarize_events"]  # fmt: skip

CUDA_ONLY = "n/a (CUDA only)"


def group_static_mask(layers: int, heads: int, kv_heads: int, rho_kv: float, seed: int = 0) -> torch.Tensor:
    """``[layers, heads]`` bool: ``round(rho_kv * layers * kv_heads)`` whole KV groups local, spread at random."""
    G = heads // kv_heads
    total = layers * kv_heads
    n = round(rho_kv * total)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    group = torch.zeros(total, dtype=torch.bool)
    group[order[:n]] = True
    return group.view(layers, kv_heads).repeat_interleave(G, dim=1)


def _no_run() -> None:
    return None


@dataclass
class DecodeConfig:
    """One configuration of the end-to-end table.

    Attributes:
        cache: ``"static"`` or ``"dynamic"``.
        make_run: ``() ->`` a prepared :class:`~qada.models.QAdARun`, or ``None`` for the unwrapped model.
        compiled: decode steps through ``torch.compile(model.forward, fullgraph=True)`` (:func:`compile_options`).
        count_events: count kernels and host syncs per step (CUDA only) in the last repetition.
        packed: the unwrapped model decodes with :func:`~benchmarks.packed_dense.packed_sdpa_forward` (the query
            heads of a KV group as rows of its K/V) instead of its own attention, which copies the K/V of a
            grouped-query model (``dense packed``: the dense anchor without that copy).
    """

    cache: str = "static"
    make_run: Callable[[], Any] = _no_run
    compiled: bool = False
    count_events: bool = False
    packed: bool = False


CACHE_KINDS = ("static", "dynamic")


def fresh_cache(model: Any, base: list[tuple[torch.Tensor, torch.Tensor]], kind: str = "static",
                capacity: int | None = None, batch: int | None = None):
    """A cache holding a copy of ``base`` (per-layer ``(K, V)`` ``[b, H_kv, T, d]``, expanded to ``batch`` rows when
    ``b = 1``): ``static`` preallocates ``capacity`` slots (default ``T + 64``), ``dynamic`` grows by one
    ``torch.cat`` per step."""
    from transformers import DynamicCache, StaticCache

    if kind not in CACHE_KINDS:
        raise ValueError(f"expected a cache kind in {CACHE_KINDS} but got {kind!r}")
    T = base[0][0].shape[2]
    if kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=capacity or T + 64)
    else:
        cache = DynamicCache(config=model.config)
    return refill_cache(cache, base, batch)


def refill_cache(cache: Any, base: list[tuple[torch.Tensor, torch.Tensor]], batch: int | None = None):
    """Empty ``cache`` in place (a static cache keeps its buffers, so compiled graphs keep their addresses) and
    write a copy of ``base`` into it; returns it."""
    cache.reset()
    for layer, (k, v) in enumerate(base):
        if batch is not None and k.shape[0] != batch:
            k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
        cache.update(k, v, layer)  # a copy: ``base`` stays intact
    return cache


def compile_options(device: torch.device | str) -> dict[str, Any]:
    """What a GPU user runs: ``fullgraph=True`` and, on CUDA, ``mode="reduce-overhead"`` (CUDA graphs)."""
    if torch.device(device).type == "cuda":
        return {"fullgraph": True, "mode": "reduce-overhead"}
    return {"fullgraph": True}


class Stepper:
    """Greedy decode steps of ``model`` on ``cache`` from ``tokens [B]`` at ``position`` (the filled length): the
    next ids and the positions stay on the device, so a step never reads the host; ``forward`` is the compiled
    forward (default: the eager model). :meth:`tokens` reads every token so far (a host sync)."""

    def __init__(self, model: Any, cache: Any, tokens: torch.Tensor, position: int | torch.Tensor,
                 forward: Callable | None = None, cudagraphs: bool = False) -> None:
        self.model, self.cache, self.forward = model, cache, forward or model
        self.ids = tokens.reshape(-1, 1)
        B, device = self.ids.shape[0], self.ids.device
        self.position = (position.reshape(-1, 1).expand(B, 1) if isinstance(position, torch.Tensor)
                         else torch.full((B, 1), position, dtype=torch.long, device=device))  # fmt: skip
        self.cudagraphs = cudagraphs
        # transformers versions whose forward takes cache_position (a static cache needs it there)
        self.pass_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.history = [self.ids]

    def __call__(self) -> torch.Tensor:
        """One step; returns its logits ``[B, V]``."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        extra = {"cache_position": self.position[0]} if self.pass_cache_position else {}
        out = self.forward(input_ids=self.ids, position_ids=self.position, past_key_values=self.cache,
                           use_cache=True, **extra)  # fmt: skip
        logits = out.logits[:, -1]
        self.ids = logits.argmax(-1, keepdim=True)
        self.position = self.position + 1
        self.history.append(self.ids)
        return logits

    def tokens(self) -> torch.Tensor:
        """``[B, 1 + steps]`` on the CPU."""
        return torch.cat(self.history, 1).cpu()


def is_copy(name: str) -> bool:
    """Whether a device event is a memcpy or memset, not a kernel."""
    return name.startswith(("Memcpy", "Memset"))


SYNC_APIS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")  # the host waits for the device
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def summarize_events(events: Iterable[tuple[str, bool]], steps: int) -> dict[str, Any]:
    """Per-step counts from profiler events ``(name, on_device)`` covering ``steps`` decode steps.

    ``kernels``: device events other than memcpy/memset (a CUDA graph's kernels included); ``launches``: kernel
    launch calls from the host, ``graph_launches``: ``cudaGraphLaunch`` calls; ``stream_syncs``: host waits
    (``cudaStreamSynchronize``, ``cudaEventSynchronize``, synchronous ``cudaMemcpy``); ``dtoh_copies``: device-to-
    host copies; ``item`` / ``local_scalar_dense``: ``aten::item`` / ``aten::_local_scalar_dense`` calls.
    ``host_round_trips`` is the largest of stream syncs, DtoH copies and scalar reads (one ``.item()`` shows in all
    three). The harness's own final ``cudaDeviceSynchronize`` is not counted.
    """
    n = dict.fromkeys(("kernels", "launches", "graph_launches", "stream_syncs", "dtoh_copies", "item",
                       "local_scalar_dense"), 0)  # fmt: skip
    for name, on_device in events:
        if on_device:
            if name.startswith("Memcpy DtoH"):
                n["dtoh_copies"] += 1
            elif not is_copy(name):
                n["kernels"] += 1
        elif name in LAUNCH_APIS:
            n["launches"] += 1
        elif name == "cudaGraphLaunch":
            n["graph_launches"] += 1
        elif name in SYNC_APIS:
            n["stream_syncs"] += 1
        elif name == "aten::item":
            n["item"] += 1
        elif name == "aten::_local_scalar_dense":
            n["local_scalar_dense"] += 1
    out: dict[str, Any] = {"steps": steps}
    out.update({f"{key}_per_step": value / steps for key, value in n.items()})
    out["host_round_trips_per_step"] = max(n["stream_syncs"], n["dtoh_copies"], n["local_scalar_dense"]) / steps
    return out


def kernel_times(kernels: Iterable[tuple[str, float, float]], steps: int) -> dict[str, Any]:
    """Where a step's device time goes, from profiled device kernels ``(name, start_us, end_us)`` covering ``steps``
    decode steps (memcpy/memset excluded by the caller: :func:`is_copy`).

    ``kernel_us_per_step``: the kernels' durations summed; ``span_us_per_step``: first start to last end (gaps
    between the kernels of a CUDA graph and between steps included); ``busy``: their ratio (a step bound by launch
    gaps or host work is far below 1); ``by_kernel``: every kernel name, longest total first, each ``{"name",
    "per_step", "us_per_step"}`` (Inductor's names say what a kernel fused).
    """
    by_name: dict[str, list[float]] = {}
    first, last = float("inf"), float("-inf")
    for name, start, end in kernels:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
        first, last = min(first, start), max(last, end)
    total = sum(t for _, t in by_name.values())
    span = last - first if by_name else 0.0
    ranked = sorted(by_name.items(), key=lambda item: (-item[1][1], item[0]))
    return {"kernel_us_per_step": total / steps, "span_us_per_step": span / steps,
            "busy": total / span if span > 0 else None,
            "by_kernel": [{"name": name, "per_step": n / steps, "us_per_step": t / steps}
                            for name, (n, t) in ranked]}  # fmt: skip


def count_step_events(model: Any, cache: Any, tokens: torch.Tensor, position: int | torch.Tensor,
                      forward: Callable | None = None, steps: int = 4, cudagraphs: bool = False) -> dict[str, Any]:
    """Kernels and host syncs per decode step of ``model`` on ``cache`` (already prefilled; qada attached or not),
    from ``tokens [B]`` at ``position``, through ``forward`` (a compiled forward; default the eager model).

    CUDA only (``torch.profiler`` with ``ProfilerActivity.CUDA``): one unprofiled step, then ``steps`` profiled
    ones (:func:`summarize_events`, :func:`kernel_times`), plus ``layers``. On another device nothing runs and the
    result is ``{"status": CUDA_ONLY}``: never a made-up number.
    """
    if tokens.device.type != "cuda":
        return {"status": CUDA_ONLY}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    stepper = Stepper(model, cache, tokens, position, forward, cudagraphs)
    stepper()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            stepper()
        torch.cuda.synchronize()
    events = list(prof.events())
    counts = summarize_events(((e.name, e.device_type == DeviceType.CUDA) for e in events), steps)
    counts.update(kernel_times(((e.name, e.time_range.start, e.time_range.end) for e in events
                                if e.device_type == DeviceType.CUDA and not is_copy(e.name)),
                               steps))  # fmt: skip
    counts["layers"] = model.config.num_hidden_layers
    return counts


def rows_of(queries: PromptQueries, batch: int) -> PromptQueries:
    """``queries`` with ``batch`` rows: a context whose one row is shared by the batch expands it."""
    expand = {layer: q.expand(batch, *q.shape[1:]) if q.shape[0] == 1 else q for layer, q in queries.queries.items()}
    return PromptQueries(queries.keep, expand, queries.scales)


@torch.no_grad()
def _decode(model, cache, base_length: int, first: torch.Tensor, run, forward, warmup: int, steps: int, device,
            cudagraphs: bool, count_steps: int, queries: PromptQueries | None = None) -> dict[str, Any]:
    if run is not None:
        attach(model, run)
    try:
        if run is not None:
            run.reset_stats()
            prefill_from_cache(run, cache, queries=queries)
        stepper = Stepper(model, cache, first, base_length, forward, cudagraphs)
        times, first_logits = [], None
        for i in range(warmup + steps):
            device_sync(device)
            t0 = time.perf_counter()
            logits = stepper()
            device_sync(device)
            times.append(time.perf_counter() - t0)
            if i == 0:
                first_logits = logits.float().cpu()
        tokens = stepper.tokens()
        summary = run.summary() if run is not None else {"sparsity": 0.0, "kv_sparsity": 0.0, "fail_safe": 0}
        components = run.describe() if run is not None else None
        # a layer step that fell back to eager (it warns once): the row must not pass for a compiled one
        eager_reason = run.layer_step.eager_reason if run is not None else None
        counters = None
        if count_steps:
            counters = count_step_events(model, cache, stepper.ids, stepper.position, forward, count_steps, cudagraphs)
    finally:
        if run is not None:
            run.remove()
    return {"first_s": times[0], "warmup_s": sum(times[:warmup]), "step_s": times[warmup:], "tokens": tokens,
            "first_logits": first_logits, "summary": summary, "components": components,
            "counters": counters, "eager_reason": eager_reason}  # fmt: skip


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of K and V one token adds to the cache of every layer."""
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * c.num_key_value_heads * d * 2 * next(model.parameters()).element_size()


def byte_ceiling(model: Any, T: int, kv_sparsity: float, t_local: int, bandwidth_gbs: float | None,
                 batch: int = 1) -> dict:
    """Bytes one decode step of ``batch`` rows must read — every weight once, and per row the K/V of dense KV groups
    over all ``T`` tokens and of skipped groups over the window only — and the time that takes at
    ``bandwidth_gbs`` (the byte ceiling)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    kv = batch * kv_bytes_per_token(model) * ((1.0 - kv_sparsity) * T + kv_sparsity * min(T, t_local))
    out = {"weight_bytes": weights, "kv_bytes": kv}
    if bandwidth_gbs:
        out["t_min_s"] = (weights + kv) / (bandwidth_gbs * 1e9)
    return out


def _memory_check(model, T: int, B: int, capacity: int, base_rows: int, dynamic: bool, device) -> str | None:
    """On CUDA: why the case cannot fit (``None`` if it can): the static cache, the base K/V and (``dynamic``) a
    growing cache alive beside them, plus 2 GiB, against the free memory (the model is loaded already)."""
    if torch.device(device).type != "cuda":
        return None
    per_token = kv_bytes_per_token(model)
    need = per_token * (B * capacity + base_rows * T + (B * T if dynamic else 0)) + 2**31
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        return f"needs ~{need / 2**30:.0f} GiB for its caches, {free / 2**30:.0f} GiB free"
    return None


def run_end_to_end(
    model: Any,
    contexts: dict[tuple[int, int], Callable[[], tuple]],
    configs: Callable[[int], dict[str, DecodeConfig]],
    steps: int,
    reps: int,
    device,
    log=print,
    bandwidth_gbs: float | None = None,
    warmup: int = 1,
    count_steps: int = 4,
    t_local: int = 128,
    model_name: str = "",
    on_case: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (context, batch size, configuration).

    Args:
        contexts: ``(T, B) -> () -> (per-layer [(K, V)], first token of each row[, the prompt's last queries])``,
            built lazily (one at a time in memory); K/V and queries with one row are shared by the ``B`` rows (a
            context's ``base_rows`` attribute says so ahead, for the memory check on CUDA).
        configs: ``B ->`` name -> :class:`DecodeConfig`; the config named ``dense`` is the reference for the
            ratios and the agreement (its cache is the suite's), ``speedup_vs_dense`` compares on the same cache,
            ``speedup_vs_dense_compiled`` with ``dense compiled``, ``speedup_vs_best_dense`` with the fastest row of the
            unwrapped model (``best_dense``: any mode, cache or attention, e.g. ``dense packed compiled``); a
            compiled row's ``eager_*`` agreement compares with its eager twin.
        warmup: untimed steps per decode (at least 1; the first is reported apart as ``first_step_s``).
        count_steps: steps profiled for :func:`count_step_events` (configs with ``count_events``, last repetition).
        bandwidth_gbs: the measured copy bandwidth, for the byte ceiling columns.
        on_case: called with the rows of each (T, B) case as soon as it is done (to save them).
    """
    if warmup < 1:
        raise ValueError(f"expected warmup >= 1 but got {warmup}")
    options = compile_options(device)
    cudagraphs = options.get("mode") == "reduce-overhead"
    rows = []
    for (T, B), make in contexts.items():
        cases = configs(B)
        capacity = T + warmup + steps + count_steps + 8
        dynamic = any(c.cache == "dynamic" for c in cases.values())
        why = _memory_check(model, T, B, capacity, getattr(make, "base_rows", B), dynamic, device)
        if why is not None:
            rows.append({"model": model_name, "T": T, "B": B, "config": "*", "skipped": why})
            log(f"  end-to-end T={T} B={B}: skipped, {why}")
            if on_case is not None:
                on_case(rows[-1:])
            continue
        t0 = time.perf_counter()
        base, first_tokens, *recorded = make()  # the prompt's last queries (a PromptQueries), where recorded
        queries = rows_of(recorded[0], B) if recorded else None
        first = torch.tensor(first_tokens, device=device)
        log(f"  end-to-end T={T} B={B}: prefill/cache built in {time.perf_counter() - t0:.1f} s")
        torch._dynamo.reset()  # each case compiles afresh: no recompile limit, no graph of another case
        static_cache = None
        runs, forwards, errors = {}, {}, {}
        for name, config in cases.items():
            try:
                runs[name] = config.make_run()
                if config.compiled:
                    if runs[name] is not None and not runs[name].executor.static_shapes:
                        raise RuntimeError(f"not graph-capturable: the executor {type(runs[name].executor).__name__} "
                                           "reads the host, so its decode step cannot compile fullgraph")
                    forwards[name] = torch.compile(model.forward, **options)
            except Exception as exc:  # one configuration failing must not lose the others
                errors[name] = repr(exc)[:400]
                log(f"    {name} FAILED: {errors[name]}")
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
        interrupted = None
        try:  # a stage's time limit interrupts (SIGINT): the rows measured so far are kept, then it stops
            for rep in range(reps):
                for name, config in cases.items():
                    if name in errors:
                        continue
                    try:
                        if config.cache == "static":
                            if static_cache is None:
                                static_cache = fresh_cache(model, base, "static", capacity, B)
                            else:
                                refill_cache(static_cache, base, B)
                            cache = static_cache
                        else:
                            cache = fresh_cache(model, base, config.cache, capacity, B)
                        packed = packed_attention(model) if config.packed else contextlib.nullcontext()
                        with _no_silent_fallback(), packed:
                            done = _decode(model, cache, T, first, runs[name], forwards.get(name), warmup, steps,
                                           device, cudagraphs and config.compiled,
                                           count_steps if config.count_events and rep == reps - 1 else 0,
                                           queries)  # fmt: skip
                        del cache
                    except Exception as exc:
                        errors[name] = repr(exc)[:400]
                        log(f"    rep {rep} {name} FAILED: {errors[name]}")
                        if torch.device(device).type == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    results[name].append(done)
                    median = Timing.of(done["step_s"])["median"]
                    log(f"    rep {rep} {name}: {B / median:.2f} tok/s (median step), first step "
                        f"{done['first_s'] * 1e3:.0f} ms, warm-up {done['warmup_s']:.2f} s")
        except KeyboardInterrupt as exc:
            interrupted = exc
            for name, done_reps in results.items():  # (each row says it; the report, after how many)
                if len(done_reps) < reps:
                    errors.setdefault(name, "interrupted (KeyboardInterrupt, e.g. a stage's time limit)")
            log(f"  end-to-end T={T} B={B}: interrupted, keeping the repetitions done")
        case = _rows(model, T, B, cases, results, errors, steps, reps, warmup, bandwidth_gbs, t_local, model_name, log)
        rows += case
        if on_case is not None:
            on_case(case)
        if interrupted is not None:
            raise interrupted
        del base, runs, forwards, results, static_cache
        torch._dynamo.reset()  # compiled graphs hold the model and the cache: let them go with the case
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _no_silent_fallback():
    """Past dynamo's recompile limit a compiled forward would silently run eagerly: make it an error instead. Every
    compiled configuration of a case compiles the one ``model.forward`` for its own run (each a guard set of its own,
    all kept: the configurations alternate), so the limit is raised to :data:`COMPILED_CONFIGS_LIMIT` first."""
    patches = {"fail_on_recompile_limit_hit": True, "recompile_limit": COMPILED_CONFIGS_LIMIT,
               "cache_size_limit": COMPILED_CONFIGS_LIMIT}
    known = {k: v for k, v in patches.items() if hasattr(torch._dynamo.config, k)}
    return torch._dynamo.config.patch(**known) if known else contextlib.nullcontext()


COMPILED_CONFIGS_LIMIT = 32
"""Compiled ``model.forward`` variants one case may hold (dynamo's default limit, 8, is fewer than the GPU suite's
compiled rows)."""


def _agreement(runs: list[dict], reference: dict) -> tuple[float, int, int]:
    """(fraction of tokens equal to ``reference``'s, worst over repetitions; shortest identical prefix over rows
    and repetitions; tokens compared per row)."""
    ref = reference["tokens"]
    fractions, prefixes = [], []
    for r in runs:
        same = r["tokens"] == ref
        fractions.append(same.float().mean().item())
        prefixes.append(int(same.int().cumprod(1).sum(1).min()))
    return min(fractions), min(prefixes), ref.shape[1]


def _rows(model, T, B, cases, results, errors, steps, reps, warmup, bandwidth_gbs, t_local, model_name, log):
    rows = []
    # a configuration that failed after some repetitions keeps them (a failure, e.g. a device error, can stop every
    # configuration at once: what was measured before it is not lost), its row says so in "error"
    measured = {name: res for name, res in results.items() if res}
    per_token = {name: Timing.of([t for r in res for t in r["step_s"]]) for name, res in measured.items()}
    first_step = {name: Timing.of([r["first_s"] for r in res]) for name, res in measured.items()}
    dense = measured.get("dense")
    unwrapped = [name for name in measured if cases[name].make_run is _no_run]  # the dense rows, every mode and cache
    best = min(unwrapped, key=lambda name: per_token[name]["median"], default=None)
    for name, config in cases.items():
        head = {"model": model_name, "T": T, "B": B, "config": name, "cache": config.cache, "compiled": config.compiled}
        if name not in measured:
            rows.append(head | {"error": errors.get(name, "no repetition finished")})
            continue
        res = measured[name]
        timing = per_token[name]
        tps = [B / Timing.of(r["step_s"])["median"] for r in res]
        summary = res[0]["summary"]
        ceiling = byte_ceiling(model, T, summary["kv_sparsity"], t_local, bandwidth_gbs, B)
        if name in errors:
            head["error"] = f"failed after {len(res)} of {reps} repetitions: {errors[name]}"
        row = head | {
            "steps_timed": steps,
            "warmup_steps": warmup,
            "reps": len(res),
            "seconds_per_token": timing,  # seconds per decode step (B tokens)
            "first_step_s": first_step[name],
            "warmup_s": Timing.of([r["warmup_s"] for r in res]),
            "tokens_per_s_median": B / timing["median"],
            "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            **ceiling,
            "ceiling_fraction": ceiling["t_min_s"] / timing["median"] if "t_min_s" in ceiling else None,
            "sparsity": summary["sparsity"],
            "sparsity_per_rep": [r["summary"]["sparsity"] for r in res],
            "kv_sparsity": summary["kv_sparsity"],
            "kv_read": summary.get("kv_read", 1.0),
            "fail_safe": summary["fail_safe"],
            "run": res[0]["components"],  # criterion, executor, moments (a stored reference's file and fingerprint)
        }
        eager_reasons = sorted({r["eager_reason"] for r in res if r.get("eager_reason")})
        if eager_reasons:  # qada's layer step ran eagerly (it could not compile): said in the row and the report
            row["layer_step_eager"] = "; ".join(eager_reasons)[:400]
        if dense:
            agreement, prefix, compared = _agreement(res, dense[0])
            row.update(
                speedup_vs_dense=per_token["dense"]["median"] / timing["median"],
                first_step_vs_dense=first_step[name]["median"] / first_step["dense"]["median"],
                tokens_compared=compared, token_agreement=agreement, identical_prefix=prefix,
                first_step_max_abs_logit_diff=(res[0]["first_logits"] - dense[0]["first_logits"]).abs().max().item(),
                first_step_same_argmax=bool((res[0]["first_logits"].argmax(-1)
                                             == dense[0]["first_logits"].argmax(-1)).all()),
            )  # fmt: skip
        if "dense compiled" in per_token:
            row["speedup_vs_dense_compiled"] = per_token["dense compiled"]["median"] / timing["median"]
        if best is not None:  # the fastest way to run the model unwrapped, of those measured
            row.update(best_dense=best, speedup_vs_best_dense=per_token[best]["median"] / timing["median"])
        twin = name.removesuffix(" compiled")
        if config.compiled and twin in measured:
            agreement, prefix, _ = _agreement(res, measured[twin][0])
            row.update(eager_agreement=agreement, eager_identical_prefix=prefix,
                       eager_sparsity=measured[twin][0]["summary"]["sparsity"])  # fmt: skip
        counters = res[-1]["counters"]
        if counters is not None:
            row["counters"] = counters
        rows.append(row)
    _extra_kernels(rows)
    for row in rows:
        if "tokens_per_s_median" not in row:
            continue
        fraction = row["ceiling_fraction"]
        log(
            f"  end-to-end T={T} B={B} {row['config']} ({row['cache']} cache): {row['tokens_per_s_median']:.2f} tok/s"
            + (f", x{row['speedup_vs_dense']:.2f} vs dense" if "speedup_vs_dense" in row else "")
            + (f", x{row['speedup_vs_dense_compiled']:.2f} vs dense compiled" if "speedup_vs_dense_compiled" in row
               else "")
            + f", sparsity {row['sparsity']:.3f} kv {row['kv_sparsity']:.3f}"
            + (f", agreement {row['token_agreement']:.2f}" if "token_agreement" in row else "")
            + (f", same tokens as eager {row['eager_agreement']:.2f}" if "eager_agreement" in row else "")
            + (f", {fraction:.0%} of the byte ceiling" if fraction is not None else "")
        )  # fmt: skip
    return rows


def _extra_kernels(rows: list[dict[str, Any]]) -> None:
    """``counters["extra_kernels_per_layer"]`` and ``counters["extra_round_trips_per_step"]`` of each counted qada
    row against the dense row of the same mode (eager or compiled)."""
    by_name = {r["config"]: r for r in rows if "counters" in r}
    for row in by_name.values():
        c = row["counters"]
        if row["config"].startswith("dense") or "kernels_per_step" not in c:  # the unwrapped model's rows
            continue
        dense = by_name.get("dense compiled" if row["compiled"] else "dense")
        d = dense and dense["counters"]
        if d and "kernels_per_step" in d:
            c["extra_kernels_per_layer"] = (c["kernels_per_step"] - d["kernels_per_step"]) / c["layers"]
            c["extra_round_trips_per_step"] = c["host_round_trips_per_step"] - d["host_round_trips_per_step"]
            if "by_kernel" in c and "by_kernel" in d:
                c["kernel_diff"] = kernel_diff(c["by_kernel"], d["by_kernel"])


def kernel_diff(kernels: list[dict[str, Any]], dense: list[dict[str, Any]], top: int = 12) -> list[dict[str, Any]]:
    """The kernels (:func:`kernel_times`' ``by_kernel``) whose count or time per step differs from ``dense``'s,
    largest time difference first (at most ``top``): ``{"name", "per_step", "us_per_step"}`` differences (a kernel
    dense runs and qada not: negative)."""
    mine = {k["name"]: k for k in kernels}
    theirs = {k["name"]: k for k in dense}
    zero = {"per_step": 0.0, "us_per_step": 0.0}
    diff = [{"name": name, **{key: mine.get(name, zero)[key] - theirs.get(name, zero)[key] for key in zero}}
            for name in mine.keys() | theirs.keys()]
    diff = [k for k in diff if k["per_step"] != 0 or abs(k["us_per_step"]) >= 1.0]
    return sorted(diff, key=lambda k: (-abs(k["us_per_step"]), k["name"]))[:top]


def static_run(mask: torch.Tensor, executor: str):
    return build_run(criterion=StaticCriterion(mask), moments="none", executor=executor)


def dense_run(executor: str):
    """qada's wrapper with the ``dense`` criterion: what the wrapper itself costs."""
    return build_run(criterion="dense", moments="none", executor=executor)


def qada_run(model, tokenizer, moments: Any, executor: str, tau: float = 0.6, compile: bool | None = None):
    """QAdA at ``tau``; ``compile``: as for :func:`qada.apply` (``None``: the default, the compiled layer step)."""
    criterion = {"name": "qada", "tau": tau}
    return prepare_run(build_run(criterion=criterion, moments=moments, executor=executor, compile=compile), model,
                       tokenizer)
