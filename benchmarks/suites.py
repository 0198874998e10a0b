"""What each suite measures: shapes, lengths, executors, repetitions, models."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from benchmarks.attention import LLAMA8B_BF16, LLAMA8B_F32, SMOLLM2, Shape

__all__ = ["SUITES", "Suite"]


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
    model: str  # "smollm2" (the embedded model), "llama3-8b-random", "tiny-random"
    e2e_lengths: list[int]
    e2e_steps: int
    e2e_reps: int
    e2e_executor: str
    e2e_moments: str
    e2e_cache: str = "static"  # the cache every configuration decodes with (the other kind: one dense row)
    e2e_real_up_to: int = 8192  # SmolLM2: real prefills up to this length, random K/V beyond (timing only)
    copy_bytes: int = 256 * 2**20
    static_rho_kv: list[float] = field(default_factory=lambda: [0.5, 0.875])
    dtype: torch.dtype = torch.float32


TINY = Shape("tiny", 1, 8, 2, 64, torch.float32)
TINY_BF16 = Shape("tiny-bf16", 1, 8, 2, 64, torch.bfloat16)

SUITES = {
    "smoke": Suite(
        "smoke", "cpu", [TINY], [512], ["sdpa"], 1, 1, False, [TINY], [512], 1, 1,
        "tiny-random", [300], 2, 1, "sdpa", "current",
        copy_bytes=4 * 2**20,
    ),
    "quick": Suite(
        "quick", "cpu", [SMOLLM2], [8192, 32768], ["sdpa"], 5, 5, False, [SMOLLM2], [8192, 32768], 5, 5,
        "smollm2", [4096, 7680], 8, 2, "sdpa", "stored",
    ),
    "full": Suite(
        "full", "cpu", [SMOLLM2, LLAMA8B_F32], [8192, 32768], ["reference", "sdpa", "flex"], 7, 10, None,
        [SMOLLM2, LLAMA8B_F32], [8192, 32768], 7, 10,
        "smollm2", [4096, 7680, 32768], 32, 5, "sdpa", "stored",
        copy_bytes=1024 * 2**20,
    ),
    "gpu": Suite(
        "gpu", "cuda", [LLAMA8B_BF16], [8192, 32768, 131072], ["sdpa", "flex", "triton"], 10, 20, None,
        [LLAMA8B_BF16], [32768, 131072], 10, 20,
        "llama3-8b-random", [32768, 131072], 16, 3, "triton", "current",
        copy_bytes=2 * 2**30, dtype=torch.bfloat16,
    ),
    "gpu-dryrun": Suite(
        "gpu-dryrun", "cpu", [TINY_BF16], [1024], ["sdpa", "flex", "triton"], 1, 1, False, [TINY_BF16], [1024], 1, 1,
        "tiny-random", [600], 2, 1, "triton", "current",
        copy_bytes=4 * 2**20, dtype=torch.bfloat16,
    ),
}  # fmt: skip
