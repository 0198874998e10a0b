"""What each suite measures: shapes, lengths, executors, repetitions, models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.attention import LLAMA8B_BF16, LLAMA8B_BF16_B8, LLAMA8B_F32, SMOLLM2, Shape
from benchmarks.parity import ParityCases

__all__ = ["SUITES", "Suite", "Workload"]


@dataclass(frozen=True)
class Workload:
    """One model of the end-to-end section and the cases decoded on it: every (length, batch size) pair.

    Attributes:
        model: ``"smollm2"`` (the embedded model, real weights, real pass-key prompts), ``"llama3-8b-random"``
            (Llama-3-8B shapes, random weights and random K/V: timing only) or ``"tiny-random"`` (smoke, dry run).
        lengths: context lengths ``T``.
        batches: batch sizes ``B`` (rows decoded together).
        compiled: eager configurations also decoded through ``torch.compile(model.forward)`` (CUDA graphs on a
            GPU), each as a row ``"<name> compiled"``.
        real_up_to: SmolLM2 only: real prefills up to this length, random K/V beyond (timing only).
        layers: keep only the first ``layers`` layers (dry run: the real model's code path at a tiny cost).
        eager: also decode ``<name> eager`` for ``qada`` and the tail rows: the same run with ``compile=False`` (its
            layer step eagerly; the default rows compile it on the static cache).
        tail: also decode the tail-aware rows (``qada_tail`` at tau 0.3, ``qada_tail_budget`` at sparsity 0.85).
        lean: also decode the :data:`LEAN_ROWS` (the accurate read-lean configuration, unfused and fused).
        moments: the moment source of the qada rows (``None``: the suite's ``e2e_moments``). A model without a
            tokenizer (random weights) cannot build a stored reference: its workloads say ``"current"``.
    """

    model: str
    lengths: tuple[int, ...]
    batches: tuple[int, ...] = (1,)
    compiled: tuple[str, ...] = ("dense", "dense packed", "qada")
    real_up_to: int = 8192
    layers: int | None = None
    eager: bool = False
    tail: bool = False
    moments: str | None = None
    lean: bool = False


@dataclass
class Suite:
    name: str
    device: str
    attention_shapes: list[Shape]
    attention_lengths: list[int]
    executors: list[str]
    attention_reps: int
    attention_inner: int
    flex_compile: bool | None
    overhead_shapes: list[Shape]
    overhead_lengths: list[int]
    overhead_reps: int
    overhead_inner: int
    e2e: list[Workload]
    e2e_steps: int  # timed decode steps per repetition (after the warm-up steps)
    e2e_reps: int
    e2e_executor: str
    e2e_moments: str
    e2e_warmup: int = 1  # untimed first steps (compilation, CUDA-graph recording); the first is reported apart
    e2e_count_steps: int = 4  # steps profiled for kernels and host syncs (CUDA only)
    e2e_cache: str = "static"  # the cache every configuration decodes with (the other kind: one dense row at B=1)
    copy_bytes: int = 256 * 2**20
    static_rho_kv: list[float] = field(default_factory=lambda: [0.5, 0.875])
    dtype: torch.dtype = torch.float32
    parity: ParityCases | None = None  # the device's decisions against the CPU's (GPU suites: a default section)


TINY = Shape("tiny", 1, 8, 2, 64, torch.float32)
TINY_BF16 = Shape("tiny-bf16", 1, 8, 2, 64, torch.bfloat16)
# random weights: no tokenizer, no stored reference; the tail rows (random K/V) time the budget rule's reads
LLAMA8B_CASES = Workload("llama3-8b-random", (32768, 131072), batches=(1, 8),
                         compiled=("dense", "dense packed", "qada dense", "qada", "qada fused", "qada_tail fused",
                                   "qada_tail fused once", "qada_tail_budget", "qada_tail_budget fused",
                                   "qada_tail_budget/group fused", "qada_tail_budget/group fused wide",
                                   "qada_tail_budget/group fused together", "qada_tail fused once together",
                                   "static rho_kv=0.875"),
                         tail=True, moments="current")  # fmt: skip

SPREAD_PAGES = 32
"""Pages per page-top program of the ``qada_tail fused spread`` row (``pages_per_program``; the executor's default is
256): at 7,680 tokens 16 programs per (row, KV head) bound a row's 481 pages, two tiles each, where the default's two
programs take 16 tiles each; the decision launch then merges 16 lists per query head instead of 2."""


WIDE_PROGRAMS = 8
"""Programs per SM that the ``wide`` rows' split count aims at (the executors' ``programs_per_sm``; the default is 2):
SmolLM2 at 7,680 tokens and B = 32: 11 splits per (row, KV head) of 11 blocks each instead of 3 of 40, so that the SMs
that hold a dense group's splits are not the launch's last by far and each program waits for fewer block loads in a
row (at B = 1 the split count is capped by the blocks, one split per four, either way). Llama-3-8B shapes at 128k and
B = 1 with 85% of the KV groups local (``qada_tail_budget/group``): 132 splits of 16 blocks instead of 33 of 63, so
that the ~15% of programs that read a bulk are spread over most SMs instead of a quarter of them."""

LEAN_TAIL = {"name": "qada_tail", "tau": 0.3, "attend_exact": True, "super_page": 16, "super_pages": 4, "pages": 4,
             "heavy": 16, "scale_exact": 8192, "shrink_exact": False}
"""The accurate read-lean configuration (``qada_tail+E/lean`` of the RULER tables and ``benchmarks/interleaved.py``:
``qada.criteria.READ_LEAN`` with ``attend_exact``; ``tests/test_benchmarks.py`` checks that it is)."""

FUSED_VARIANTS: dict[str, tuple[str | dict[str, Any], dict[str, Any]]] = {
    "qada fused wide": ("qada", {"name": "triton_fused", "decide_once": False, "programs_per_sm": WIDE_PROGRAMS}),
    "qada fused once wide": ("qada", {"name": "triton_fused", "decide_once": True, "programs_per_sm": WIDE_PROGRAMS}),
    "qada_tail fused wide": ("qada_tail", {"name": "triton_fused", "decide_once": False,
                                           "programs_per_sm": WIDE_PROGRAMS}),
    "qada fused inductor": ("qada", {"name": "triton_fused", "decide_once": False, "compile_step": True}),
    "qada fused pdl": ("qada", {"name": "triton_fused", "decide_once": False, "pdl": True}),
    "qada_tail fused pdl": ("qada_tail", {"name": "triton_fused", "decide_once": False, "pdl": True}),
    "qada_tail fused spread": ("qada_tail", {"name": "triton_fused", "decide_once": True,
                                             "pages_per_program": SPREAD_PAGES}),
    "qada_tail_budget/group fused": ({"name": "qada_tail_budget", "sparsity": 0.85, "per_group": True},
                                     {"name": "triton_fused"}),
    "qada_tail_budget/group fused wide": ({"name": "qada_tail_budget", "sparsity": 0.85, "per_group": True},
                                          {"name": "triton_fused", "programs_per_sm": WIDE_PROGRAMS}),
    "qada_tail_budget/group fused together": ({"name": "qada_tail_budget", "sparsity": 0.85, "per_group": True},
                                              {"name": "triton_fused", "heads_apart": False}),
    "qada_tail+E/lean fused uncapped": (LEAN_TAIL, {"name": "triton_fused", "cap_registers": False}),
    "qada_tail fused once together": ("qada_tail", {"name": "triton_fused", "decide_once": True,
                                                    "heads_apart": False}),
    "qada_tail fused splits": ("qada_tail", {"name": "triton_fused", "decide_once": False}),
    "qada fused unspread": ("qada", {"name": "triton_fused", "decide_once": False, "spread_moments": False}),
    "qada_tail fused unspread": ("qada_tail", {"name": "triton_fused", "spread_moments": False}),
    "qada fused estimating": ("qada", {"name": "triton_fused", "decide_once": False, "estimate_in_splits": True}),
}  # fmt: skip
"""Rows built only where a workload's compiled rows name them (the GPU suite's; on the CPU, under Triton's
interpreter, each would be its plain ``fused`` row again): name -> (``qada`` or a criterion of
:data:`~benchmarks.models.TAIL_CONFIGS`, executor). ``inductor``: the layer step compiled by Inductor
(``compile_step``); ``pdl``: programmatic dependent launches; ``spread``: ``qada_tail``'s page bounds over programs
of :data:`SPREAD_PAGES` pages; ``wide``: splits for :data:`WIDE_PROGRAMS` programs per SM
(``once``: the plain ``qada`` decision made once per group, by the moment step's launch, rather than in each of the
more splits); ``qada_tail_budget/group``: the budget rule over whole KV groups (``per_group``: 85%
of each row's groups local, so that a budget skips whole groups' bytes; a criterion given as its arguments);
``uncapped``: the read-lean split kernel without its register cap (``cap_registers=False``: what ``ptxas`` chooses,
two programs per SM with Triton 3.6, against the default's three); ``together``: the budget's score launch, or
``qada_tail``'s decision launched apart (``once``), one program per (row, KV head) (``heads_apart=False``), against
the default's one per query head where that grid fits one wave (as at B = 1: SmolLM2's 9 heads, Llama-3-8B's 32);
``qada_tail fused splits``: the decision in every split (``decide_once=False``) where the default decides once
(above ``pages_per_program`` bounded pages: SmolLM2 at 7,680 tokens has 481; the GPU results of 2026-11-28 and before
name this row ``qada_tail fused``); ``unspread``: the moment step's launch one program per (row, KV head), every block
pair of its state in turn (``spread_moments=False``, as until 2026-12-06), against the default's one per block pair;
``qada fused estimating``: each split computes its heads' ``log E[exp(s)]`` from the moments (``estimate_in_splits``),
the moment step's launch only updating the state. ``pdl`` and ``wide`` decide in the splits too."""

LEAN_ROWS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qada_tail+E/lean": (LEAN_TAIL, {"name": "triton"}),
    "qada_tail+E/lean fused": (LEAN_TAIL, {"name": "triton_fused"}),
    "qada_tail+E/lean fused once": (LEAN_TAIL, {"name": "triton_fused", "decide_once": True}),
}
"""Rows of a workload with ``lean`` (the GPU suite and its dry run): name -> (criterion, executor). The accurate
configuration decided by its torch layer step (compiled on the static cache) and in the ``triton_fused`` kernels
(moment step, split, combine): by default (at 7,680 tokens) in every split, with ``once`` in a launch of its own
before the split, as a user's ``decide_once=True``; the splits' repeated decisions are most of what the fused step
accesses (``benchmarks/launch_bytes.py``)."""

# stored moments, as the CPU suites: the same decisions as there (the GPU runs of 2026-11-24 used current moments,
# which on the same prompts decide sparsity .30-.33 against stored's .69, on the CPU as on the GPU)
SMOLLM2_GPU = Workload("smollm2", (7680,), batches=(1, 32),
                       compiled=("dense", "dense packed", "qada dense", "qada", "qada fused", "qada fused once",
                                 "qada fused inductor", "qada fused pdl", "qada fused wide", "qada fused once wide",
                                 "qada_tail", "qada_tail fused", "qada_tail fused once", "qada_tail fused pdl",
                                 "qada_tail fused spread", "qada_tail fused wide", "qada_tail fused once together",
                                 "qada_tail fused splits", "qada fused unspread", "qada_tail fused unspread",
                                 "qada fused estimating", "qada_tail_budget", "qada_tail_budget fused", *LEAN_ROWS,
                                 "qada_tail+E/lean fused uncapped"),
                       eager=True, tail=True, lean=True,
                       moments="stored")  # fmt: skip

DRY_RUN_COMPILED = tuple(name for name in SMOLLM2_GPU.compiled if name not in {*FUSED_VARIANTS, *LEAN_ROWS})
"""The GPU suite's compiled rows in its dry run: not the :data:`LEAN_ROWS` (decoded, but not also through a compiled
model step: that is the other rows' path, minutes of Inductor on the CPU for no new code), not the fused variants
(:data:`FUSED_VARIANTS`),
each of which is its plain ``fused`` row again there: under Triton's interpreter a layer step with Triton launches
runs eagerly and launches are ordinary, and at the dry run's 256 tokens (16 pages) no page bounds are spread (each
variant's own path is tested: ``tests/test_fused_decision.py``, ``tests/test_fused_tail.py``)."""

SUITES = {
    "smoke": Suite(
        "smoke", "cpu", [TINY], [512], ["sdpa"], 1, 1, False, [TINY], [512], 1, 1,
        [Workload("tiny-random", (300,), batches=(1, 2), tail=True)], 2, 1, "sdpa", "current",
        copy_bytes=4 * 2**20,
    ),
    "quick": Suite(
        "quick", "cpu", [SMOLLM2], [8192, 32768], ["sdpa"], 5, 5, False, [SMOLLM2], [8192, 32768], 5, 5,
        [Workload("smollm2", (4096, 7680), eager=True, tail=True,
                  compiled=("dense", "dense packed", "qada", "qada_tail"))], 8, 2, "sdpa", "stored",
    ),
    "full": Suite(
        "full", "cpu", [SMOLLM2, LLAMA8B_F32], [8192, 32768], ["reference", "sdpa", "flex"], 7, 10, None,
        [SMOLLM2, LLAMA8B_F32], [8192, 32768], 7, 10,
        [Workload("smollm2", (4096, 7680, 32768), eager=True, tail=True)], 32, 5, "sdpa", "stored",
        copy_bytes=1024 * 2**20,
    ),
    "gpu": Suite(
        "gpu", "cuda", [LLAMA8B_BF16, LLAMA8B_BF16_B8], [8192, 32768, 131072], ["sdpa", "flex", "triton"], 10, 20,
        None,
        [LLAMA8B_BF16], [32768, 131072], 10, 20,
        [SMOLLM2_GPU, LLAMA8B_CASES], 16, 3, "triton", "current",
        e2e_warmup=3, copy_bytes=2 * 2**30, dtype=torch.bfloat16, parity=ParityCases(),
    ),
    "gpu-dryrun": Suite(
        "gpu-dryrun", "cpu", [TINY_BF16], [1024], ["sdpa", "flex", "triton"], 1, 1, False, [TINY_BF16], [1024], 1, 1,
        [Workload("smollm2", (256,), batches=(2,), layers=2, compiled=DRY_RUN_COMPILED, eager=True,
                  tail=True, lean=True, moments=SMOLLM2_GPU.moments),
         Workload("tiny-random", (600,), compiled=LLAMA8B_CASES.compiled, tail=True, moments="current")],
        1, 1, "triton", "current",  # (two decode steps per row: the first compiles, the second reuses it)
        e2e_warmup=1, e2e_count_steps=2, copy_bytes=4 * 2**20, static_rho_kv=[0.875], dtype=torch.bfloat16,
        parity=ParityCases(length=256, tokens=2, layers=2),
    ),
}  # fmt: skip
