"""The models and prefilled contexts of the end-to-end benchmark, and the configurations compared on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from benchmarks.common import keep_first_layers
from benchmarks.end_to_end import DecodeConfig, dense_run, group_static_mask, static_run
from benchmarks.suites import FUSED_VARIANTS, LEAN_ROWS, Suite, Workload
from qada.models import build_run, prepare_run
from qada.models.prompt_queries import PromptQueries

__all__ = ["build_configs", "build_contexts", "build_model", "passkey_rows"]


def build_model(suite: Suite, workload: Workload, max_length: int) -> tuple[Any, Any, str]:
    """``(model, tokenizer or None, description)`` on the suite's device, in the suite's dtype."""
    import transformers

    dtype = str(suite.dtype).replace("torch.", "")
    if workload.model == "smollm2":
        from qada.models.loading import load_model

        model, tokenizer = load_model("smollm2-135m", dtype=suite.dtype, device=suite.device)
        what = f"SmolLM2-135M-Instruct (embedded, real weights, dequantised Q4_1 -> {dtype})"
        if workload.layers:
            total = keep_first_layers(model, workload.layers)
            what += f", only its first {workload.layers} of {total} layers (dry run)"
        return model, tokenizer, what
    if workload.model == "llama3-8b-random":
        size = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=128256)  # fmt: skip
        what = f"Llama-3-8B-shaped LlamaForCausalLM with RANDOM weights ({dtype}; timing only, outputs are meaningless)"
    elif workload.model == "tiny-random":
        size = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=1024, vocab_size=1000)  # fmt: skip
        what = f"tiny random LlamaForCausalLM ({dtype}; smoke/dry run: 2 layers, 8 heads, 2 KV heads, d=64)"
    else:
        raise ValueError(f"expected a model in ('smollm2', 'llama3-8b-random', 'tiny-random') but got "
                         f"{workload.model!r}")
    config = transformers.LlamaConfig(
        **size, max_position_embeddings=max(2 * max_length, 4096), rope_theta=500000.0, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(suite.dtype)
    try:
        with torch.device(suite.device):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    return model, None, what


def passkey_rows(tokenizer: Any, T: int, batch: int) -> torch.Tensor:
    """``[batch, T]`` pass-key prompts of exactly ``T`` tokens: row ``i`` hides its own key (seed ``i``) at a
    depth spread over [0.1, 0.9] (0.5 for a single row); a prompt longer than ``T`` loses the haystack tokens
    just before its needle."""
    from qada.eval.passkey import passkey_prompt

    rows = []
    for i in range(batch):
        depth = 0.5 if batch == 1 else 0.1 + 0.8 * i / (batch - 1)
        prompt = passkey_prompt(tokenizer, length=T + 16, depth=depth, seed=i)
        ids, cut = prompt.input_ids[0], prompt.needle_position
        excess = ids.shape[0] - T
        if excess < 0 or cut - excess < 1:
            raise ValueError(f"cannot trim a pass-key prompt of {ids.shape[0]} tokens to {T} (needle at {cut})")
        rows.append(torch.cat([ids[: cut - excess], ids[cut:]]))
    return torch.stack(rows)


Context = Callable[[], tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int], PromptQueries]]
PROMPT_QUERIES = 32  # the prompt's last queries kept per layer: the tail-aware rows' observation window


def build_contexts(suite: Suite, workload: Workload, model: Any, tokenizer: Any) -> dict[tuple[int, int], Context]:
    """``(T, B) -> () -> (per-layer [(K, V)], first token of each row, the prompt's last queries per layer)``.

    SmolLM2 up to ``workload.real_up_to`` tokens: ``B`` real pass-key prompts (:func:`passkey_rows`), each
    prefilled on its own, K/V ``[B, H_kv, T, d]``, its last :data:`PROMPT_QUERIES` queries recorded. Otherwise
    random K/V ``[1, H_kv, T, d]`` and queries shared by the ``B`` rows (random models, and SmolLM2's long "timing
    only" case: no accuracy from it).
    """
    from qada.eval.decode import prefill

    def real(T: int, B: int) -> Context:
        def make():
            ids = passkey_rows(tokenizer, T, B).to(suite.device)
            keys, values, first, queries = [], [], [], []
            for row in ids:
                done = prefill(model, row[None], keep_queries=PROMPT_QUERIES)
                keys.append([layer.keys for layer in done.cache.layers])
                values.append([layer.values for layer in done.cache.layers])
                first.append(int(done.last_logits.argmax(-1)))
                queries.append(done.queries)
                del done
            base = [(torch.cat([k[layer] for k in keys]), torch.cat([v[layer] for v in values]))
                    for layer in range(len(keys[0]))]  # fmt: skip
            recorded = PromptQueries(PROMPT_QUERIES, {layer: torch.cat([q.queries[layer] for q in queries])
                                                      for layer in queries[0].queries}, queries[0].scales)
            return base, first, recorded

        return make

    def random(T: int, B: int) -> Context:
        def make():
            c = model.config
            d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            g = torch.Generator(device=suite.device).manual_seed(T)
            shape = (1, c.num_key_value_heads, T, d)
            base = [
                tuple(torch.randn(shape, generator=g, device=suite.device, dtype=suite.dtype) for _ in range(2))
                for _ in range(c.num_hidden_layers)
            ]
            q_shape = (1, c.num_attention_heads, min(PROMPT_QUERIES, T), d)
            queries = PromptQueries(PROMPT_QUERIES, {
                layer: torch.randn(q_shape, generator=g, device=suite.device, dtype=suite.dtype)
                for layer in range(c.num_hidden_layers)}, dict.fromkeys(range(c.num_hidden_layers), d ** -0.5))
            return base, [1] * B, queries

        make.base_rows = 1  # the B rows share one row of K/V (the memory check of run_end_to_end)
        return make

    real_up_to = workload.real_up_to if tokenizer is not None else 0
    return {(T, B): (real(T, B) if T <= real_up_to else random(T, B))
            for T in workload.lengths for B in workload.batches}  # fmt: skip


TAIL_CONFIGS = {  # the tail-aware criteria (issue 23): the threshold rule at tau 0.3, the budget rule at 0.85
    "qada_tail": {"name": "qada_tail", "tau": 0.3},
    "qada_tail_budget": {"name": "qada_tail_budget", "sparsity": 0.85},
}


def build_configs(suite: Suite, workload: Workload, model: Any, tokenizer: Any, batch: int) -> dict[str, DecodeConfig]:
    """name -> :class:`~benchmarks.end_to_end.DecodeConfig`, all on the suite's cache unless named otherwise.

    ``dense`` (the unwrapped model, the reference), the unwrapped model on the other cache kind (what a user who
    changes nothing gets; at B = 1 only: a growing cache doubles the memory of large batches), ``dense packed`` (the
    unwrapped model attending without transformers' copy of a grouped-query model's K/V:
    :mod:`benchmarks.packed_dense`; transformers' own attention for a model whose every query head has its own KV
    head), ``qada dense`` (the
    wrapper with the ``dense`` criterion: its own cost), ``qada`` (tau 0.6, the suite's moments and executor; with the
    ``triton`` executor also ``qada fused``, ``qada_tail fused`` and ``qada_tail_budget fused``: the same decisions
    made in the kernels, ``triton_fused`` with its defaults (what a user gets: ``qada`` decided in every split,
    ``qada_tail`` in every split up to ``pages_per_program`` bounded pages and once beyond, as at 7,680 tokens), and
    the first two's ``once`` twins with ``decide_once=True``: the decision made once per group, by the moment step's
    launch for ``qada``, in a launch of its own for ``qada_tail``, then the split; the rows of
    :data:`FUSED_VARIANTS` where ``workload.compiled`` names them, such as ``qada_tail fused splits``), the rows of
    :data:`~benchmarks.suites.LEAN_ROWS` (the accurate read-lean configuration) if ``workload.lean``, the
    tail-aware rows of :data:`TAIL_CONFIGS` (if ``workload.tail``; their heavy set chosen by the context's recorded
    prompt queries), ``static rho_kv=...`` (whole KV groups forced local): every qada row on the run's default path
    (its layer step compiled on the static cache); with ``workload.eager`` also ``<name> eager`` for ``qada`` and
    the tail rows (``compile=False``: the same step, eagerly); and ``<name> compiled`` for each name of
    ``workload.compiled``: the same run, the model's decode steps through ``torch.compile`` (CUDA graphs on a GPU).
    """
    c = model.config
    kind = suite.e2e_cache
    other = "dynamic" if kind == "static" else "static"
    configs: dict[str, DecodeConfig] = {"dense": DecodeConfig(kind, count_events=True)}
    if batch == 1:
        configs[f"dense {other} cache"] = DecodeConfig(other)
    configs["dense packed"] = DecodeConfig(kind, packed=True, count_events=True)
    configs["qada dense"] = DecodeConfig(kind, lambda: dense_run(suite.e2e_executor), count_events=True)
    criteria = {"qada": {"name": "qada", "tau": 0.6}, **(TAIL_CONFIGS if workload.tail else {})}
    moments = workload.moments or suite.e2e_moments
    for name, criterion in criteria.items():
        for compile, suffix in ((None, ""),) + (((False, " eager"),) if workload.eager else ()):
            configs[name + suffix] = DecodeConfig(kind, lambda criterion=criterion, compile=compile: prepare_run(
                build_run(criterion=criterion, moments=moments, executor=suite.e2e_executor, compile=compile),
                model, tokenizer), count_events=not suffix)
    if suite.e2e_executor == "triton":  # the decision inside the kernels (triton_fused): qada and the tail rows
        for name in [n for n in ("qada", "qada_tail", "qada_tail_budget") if n in criteria]:
            variants = (("", None),) if name == "qada_tail_budget" else (("", None), (" once", True))
            for suffix, once in variants:  # the executor's default, or the decision launched once (a budget always is)
                executor = {"name": "triton_fused", **({} if once is None else {"decide_once": once})}
                configs[f"{name} fused{suffix}"] = DecodeConfig(
                    kind, lambda criterion=criteria[name], executor=executor: prepare_run(
                        build_run(criterion=criterion, moments=moments, executor=executor), model, tokenizer),
                    count_events=True)
    if suite.e2e_executor == "triton":  # the variants a workload names among its compiled rows (the GPU suite's)
        for name, (criterion, executor) in FUSED_VARIANTS.items():
            if name in workload.compiled:
                criterion = criterion if isinstance(criterion, dict) else criteria[criterion]
                configs[name] = DecodeConfig(kind, lambda criterion=criterion, executor=executor: prepare_run(
                    build_run(criterion=criterion, moments=moments, executor=executor), model, tokenizer),
                    count_events=True)
    for name, (criterion, executor) in (LEAN_ROWS if workload.lean else {}).items():  # the accurate configuration
        configs[name] = DecodeConfig(kind, lambda criterion=criterion, executor=executor: prepare_run(
            build_run(criterion=criterion, moments=moments, executor=executor), model, tokenizer), count_events=True)
    for rho in suite.static_rho_kv:
        mask = group_static_mask(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, rho)
        configs[f"static rho_kv={rho}"] = DecodeConfig(kind, lambda mask=mask: static_run(mask, suite.e2e_executor))
    for name in workload.compiled:
        if name not in configs:
            raise ValueError(f"expected compiled configurations among {sorted(configs)} but got {name!r}")
        configs[f"{name} compiled"] = replace(configs[name], compiled=True)
    return configs
