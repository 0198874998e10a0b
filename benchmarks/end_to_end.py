"""End-to-end greedy decoding: dense (the unwrapped model) vs QAdA vs forced sparsity, from one shared prefill.

For each context length the prompt is prefilled once (CPU: the real model on a pass-key prompt; GPU: random
K/V written into the cache, the model has random weights anyway). Every (configuration, repetition) then
decodes from a fresh :class:`~transformers.DynamicCache` holding the same K/V: one untimed decode step (it
also initialises the moment state and gives the first-step logits for the agreement column), then ``steps``
timed steps. Configurations alternate inside each repetition so that drifting machine load hits all alike.
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


def _fresh_cache(model: Any, base: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(base):
        cache.update(k, v, layer)  # a copy (torch.cat onto an empty tensor): ``base`` stays intact
    return cache


@torch.no_grad()
def _decode(model, base, first_token: int, steps: int, run, device) -> dict[str, Any]:
    cache = _fresh_cache(model, base)
    if run is not None:
        attach(model, run)
    try:
        if run is not None:
            run.prefill_from_cache(cache)
        tokens = [first_token]

        def step() -> torch.Tensor:
            ids = torch.tensor([[tokens[-1]]], device=device)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            tokens.append(int(logits.argmax()))
            return logits

        first_logits = step().float().cpu()  # untimed: moment initialisation, lazy allocations
        device_sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        device_sync(device)
        seconds = time.perf_counter() - t0
    finally:
        if run is not None:
            run.remove()
    return {"seconds": seconds, "tokens": tokens, "first_logits": first_logits}


def run_end_to_end(
    model: Any,
    contexts: dict[int, Callable[[], tuple[list[tuple[torch.Tensor, torch.Tensor]], int]]],
    configs: dict[str, Callable[[], Any]],
    steps: int,
    reps: int,
    device,
    log=print,
) -> list[dict[str, Any]]:
    """One row per (context, configuration).

    Args:
        contexts: ``T -> () -> (per-layer [(K, V)], first token)``, built lazily (one at a time in memory).
        configs: name -> a factory of a prepared :class:`~qada.models.QAdARun`, or ``None`` for dense; the
            first must be ``dense`` (the reference for the ratios and the agreement).
    """
    rows = []
    for T, make in contexts.items():
        t0 = time.perf_counter()
        base, first_token = make()
        log(f"  end-to-end T={T}: prefill/cache built in {time.perf_counter() - t0:.1f} s")
        runs = {name: factory() for name, factory in configs.items()}
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for rep in range(reps):
            for name, run in runs.items():
                results[name].append(_decode(model, base, first_token, steps, run, device))
                log(f"    rep {rep} {name}: {steps / results[name][-1]['seconds']:.2f} tok/s")
        dense = results["dense"]
        dense_per_token = Timing.of([r["seconds"] / steps for r in dense])["median"]
        for name, run in runs.items():
            tps = [steps / r["seconds"] for r in results[name]]
            timing = Timing.of([r["seconds"] / steps for r in results[name]])
            first = results[name][0]
            same = [a == b for a, b in zip(first["tokens"], dense[0]["tokens"], strict=True)]
            prefix = next((i for i, s in enumerate(same) if not s), len(same))
            row = {
                "T": T,
                "config": name,
                "steps_timed": steps,
                "reps": reps,
                "seconds_per_token": timing,
                "tokens_per_s_median": 1.0 / timing["median"],
                "tokens_per_s_min": min(tps),
                "tokens_per_s_max": max(tps),
                "speedup_vs_dense": dense_per_token / timing["median"],
                "tokens_compared": len(same),
                "token_agreement": sum(same) / len(same),
                "identical_prefix": prefix,
                "first_step_max_abs_logit_diff": (first["first_logits"] - dense[0]["first_logits"]).abs().max().item(),
                "first_step_same_argmax": bool(first["first_logits"].argmax() == dense[0]["first_logits"].argmax()),
            }
            if run is not None:
                summary = run.summary()
                row.update(sparsity=summary["sparsity"], kv_sparsity=summary["kv_sparsity"],
                           fail_safe=summary["fail_safe"])  # fmt: skip
            else:
                row.update(sparsity=0.0, kv_sparsity=0.0)
            rows.append(row)
            log(
                f"  end-to-end T={T} {name}: {row['tokens_per_s_median']:.2f} tok/s, x{row['speedup_vs_dense']:.2f}"
                f" vs dense, sparsity {row['sparsity']:.3f} kv {row['kv_sparsity']:.3f}, agreement "
                f"{row['token_agreement']:.2f}"
            )
        del base, runs, results
    return rows


def static_run(mask: torch.Tensor, executor: str):
    return build_run(criterion=StaticCriterion(mask), moments="none", executor=executor)


def qada_run(model, tokenizer, moments: Any, executor: str, tau: float = 0.6):
    return prepare_run(build_run(criterion={"name": "qada", "tau": tau}, moments=moments, executor=executor),
                       model, tokenizer)  # fmt: skip
