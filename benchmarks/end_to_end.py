"""End-to-end greedy decoding: dense (the unwrapped model) vs QAdA vs forced sparsity, from one shared prefill.

For each context length the prompt is prefilled once (CPU: the real model on a pass-key prompt, or random K/V
written into the cache for the long "timing only" case; GPU: random K/V, the model has random weights anyway).
Every (configuration, repetition) then decodes from a fresh cache holding the same K/V — a preallocated
``StaticCache`` (the default) or a ``DynamicCache`` that grows by ``torch.cat`` — and times every decode step
on its own: the first step (moment set-up, lazy allocations) is reported apart, the median of the others is the
steady per-token time. Configurations alternate inside each repetition so that drifting machine load hits all
alike. Each row also gives the byte ceiling: weights + the K/V an ideal kernel reads, over the measured copy
bandwidth, and the fraction of it reached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import Timing, device_sync
from qada.criteria import StaticCriterion
from qada.models import attach, build_run, prepare_run

__all__ = ["group_static_mask", "run_end_to_end"]


def group_static_mask(layers: int, heads: int, kv_heads: int, rho_kv: float, seed: int = 0) -> torch.Tensor:
    """``[layers, heads]`` bool: ``round(rho_kv * layers * kv_heads)`` whole KV groups local, spread at random."""
    G = heads // kv_heads
    total = layers * kv_heads
    n = round(rho_kv * total)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    group = torch.zeros(total, dtype=torch.bool)
    group[order[:n]] = True
    return group.view(layers, kv_heads).repeat_interleave(G, dim=1)


CACHE_KINDS = ("static", "dynamic")


def fresh_cache(model: Any, base: list[tuple[torch.Tensor, torch.Tensor]], kind: str = "static",
                capacity: int | None = None):
    """A cache holding a copy of ``base`` (per-layer ``(K, V)`` ``[b, H_kv, T, d]``): ``static`` preallocates
    ``capacity`` slots (default ``T + 64``), ``dynamic`` grows by one ``torch.cat`` per step."""
    from transformers import DynamicCache, StaticCache

    if kind not in CACHE_KINDS:
        raise ValueError(f"expected a cache kind in {CACHE_KINDS} but got {kind!r}")
    T = base[0][0].shape[2]
    if kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=capacity or T + 64)
    else:
        cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(base):
        cache.update(k, v, layer)  # a copy: ``base`` stays intact
    return cache


@torch.no_grad()
def _decode(model, base, first_token: int, steps: int, run, device, cache_kind: str) -> dict[str, Any]:
    T = base[0][0].shape[2]
    cache = fresh_cache(model, base, cache_kind, T + steps + 8)
    if run is not None:
        attach(model, run)
    try:
        if run is not None:
            run.reset_stats()
            run.prefill_from_cache(cache)
        tokens = [first_token]
        times = []

        def step() -> torch.Tensor:
            device_sync(device)
            t0 = time.perf_counter()
            ids = torch.tensor([[tokens[-1]]], device=device)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            tokens.append(int(logits.argmax()))  # the host needs the token anyway: this is the step's one sync
            times.append(time.perf_counter() - t0)
            return logits

        first_logits = step().float().cpu()  # the first step: moment set-up, lazy allocations
        for _ in range(steps):
            step()
    finally:
        if run is not None:
            run.remove()
    summary = run.summary() if run is not None else {"sparsity": 0.0, "kv_sparsity": 0.0, "fail_safe": 0}
    return {"first_s": times[0], "step_s": times[1:], "seconds": sum(times[1:]), "tokens": tokens,
            "first_logits": first_logits, "summary": summary}


def byte_ceiling(model: Any, T: int, kv_sparsity: float, t_local: int, bandwidth_gbs: float | None) -> dict:
    """Bytes one decode token must read — every weight once, the K/V of dense KV groups over all ``T`` tokens and
    of skipped groups over the window only — and the time that takes at ``bandwidth_gbs`` (the byte ceiling)."""
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    element = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    per_token_kv = c.num_hidden_layers * c.num_key_value_heads * d * 2 * element
    kv = per_token_kv * ((1.0 - kv_sparsity) * T + kv_sparsity * min(T, t_local))
    out = {"weight_bytes": weights, "kv_bytes": kv}
    if bandwidth_gbs:
        out["t_min_s"] = (weights + kv) / (bandwidth_gbs * 1e9)
    return out


def run_end_to_end(
    model: Any,
    contexts: dict[int, Callable[[], tuple[list[tuple[torch.Tensor, torch.Tensor]], int]]],
    configs: dict[str, tuple[str, Callable[[], Any]]],
    steps: int,
    reps: int,
    device,
    log=print,
    bandwidth_gbs: float | None = None,
    t_local: int = 128,
) -> list[dict[str, Any]]:
    """One row per (context, configuration).

    Args:
        contexts: ``T -> () -> (per-layer [(K, V)], first token)``, built lazily (one at a time in memory).
        configs: name -> ``(cache kind, factory)``: the factory gives a prepared :class:`~qada.models.QAdARun`,
            or ``None`` for the unwrapped model; the config named ``dense`` is the reference for the ratios and
            the agreement (its cache is the suite's), ``speedup_vs_dense`` compares on the same cache.
        bandwidth_gbs: the measured copy bandwidth, for the byte ceiling columns.
    """
    rows = []
    for T, make in contexts.items():
        t0 = time.perf_counter()
        base, first_token = make()
        log(f"  end-to-end T={T}: prefill/cache built in {time.perf_counter() - t0:.1f} s")
        runs = {name: (kind, factory()) for name, (kind, factory) in configs.items()}
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for rep in range(reps):
            for name, (kind, run) in runs.items():
                results[name].append(_decode(model, base, first_token, steps, run, device, kind))
                median = Timing.of(results[name][-1]["step_s"])["median"]
                log(f"    rep {rep} {name}: {1 / median:.2f} tok/s (median step), first step "
                    f"{results[name][-1]['first_s'] * 1e3:.0f} ms")
        per_token = {name: Timing.of([t for r in res for t in r["step_s"]]) for name, res in results.items()}
        first_step = {name: Timing.of([r["first_s"] for r in res]) for name, res in results.items()}
        dense = results["dense"]
        for name, (kind, _run) in runs.items():
            # every step of every repetition: the median is robust to the odd slow step
            timing = per_token[name]
            tps = [1.0 / Timing.of(r["step_s"])["median"] for r in results[name]]
            first = results[name][0]
            same = [a == b for a, b in zip(first["tokens"], dense[0]["tokens"], strict=True)]
            prefix = next((i for i, s in enumerate(same) if not s), len(same))
            summary = first["summary"]
            ceiling = byte_ceiling(model, T, summary["kv_sparsity"], t_local, bandwidth_gbs)
            row = {
                "T": T,
                "config": name,
                "cache": kind,
                "steps_timed": steps,
                "reps": reps,
                "seconds_per_token": timing,
                "first_step_s": first_step[name],
                "first_step_vs_dense": first_step[name]["median"] / first_step["dense"]["median"],
                "tokens_per_s_median": 1.0 / timing["median"],
                "tokens_per_s_min": min(tps),
                "tokens_per_s_max": max(tps),
                "speedup_vs_dense": per_token["dense"]["median"] / timing["median"],
                **ceiling,
                "ceiling_fraction": ceiling["t_min_s"] / timing["median"] if "t_min_s" in ceiling else None,
                "tokens_compared": len(same),
                "token_agreement": sum(same) / len(same),
                "identical_prefix": prefix,
                "first_step_max_abs_logit_diff": (first["first_logits"] - dense[0]["first_logits"]).abs().max().item(),
                "first_step_same_argmax": bool(first["first_logits"].argmax() == dense[0]["first_logits"].argmax()),
            }
            row.update(sparsity=summary["sparsity"], kv_sparsity=summary["kv_sparsity"],
                       fail_safe=summary["fail_safe"])  # fmt: skip
            rows.append(row)
            fraction = row["ceiling_fraction"]
            log(
                f"  end-to-end T={T} {name} ({kind} cache): {row['tokens_per_s_median']:.2f} tok/s, "
                f"x{row['speedup_vs_dense']:.2f} vs dense, first step x{row['first_step_vs_dense']:.2f}, sparsity "
                f"{row['sparsity']:.3f} kv {row['kv_sparsity']:.3f}, agreement {row['token_agreement']:.2f}"
                + (f", {fraction:.0%} of the byte ceiling" if fraction is not None else "")
            )
        del base, runs, results
    return rows


def static_run(mask: torch.Tensor, executor: str):
    return build_run(criterion=StaticCriterion(mask), moments="none", executor=executor)


def dense_run(executor: str):
    """qada's wrapper with the ``dense`` criterion: what the wrapper itself costs."""
    return build_run(criterion="dense", moments="none", executor=executor)


def qada_run(model, tokenizer, moments: Any, executor: str, tau: float = 0.6):
    return prepare_run(build_run(criterion={"name": "qada", "tau": tau}, moments=moments, executor=executor),
                       model, tokenizer)  # fmt: skip
