"""Decode statistics of a run, torchmetrics-style: ``update`` per (layer, step) on the device, ``compute`` once.

Nothing in :meth:`DecodeStatistics.update` synchronises with the host: sums stay 0-d tensors on the device and
only :meth:`DecodeStatistics.compute` reads them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DecodeStatistics"]


class DecodeStatistics:
    """Per-layer sums of sparsity and kv_sparsity over decode steps, and the fail-safe count."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sparsity: dict[int, torch.Tensor] = {}
        self.kv_sparsity: dict[int, torch.Tensor] = {}
        self.steps: dict[int, int] = {}
        self.fail_safe: torch.Tensor | None = None

    def update(
        self,
        layer: int,
        sparsity: torch.Tensor,
        kv_sparsity: torch.Tensor,
        fail_safe: torch.Tensor | None = None,
    ) -> None:
        """Add one decode step of ``layer`` (0-d tensors from the executor; ``fail_safe``: heads forced dense)."""
        sparsity = sparsity.detach().float()
        kv_sparsity = kv_sparsity.detach().float()
        if layer in self.sparsity:
            self.sparsity[layer] = self.sparsity[layer] + sparsity
            self.kv_sparsity[layer] = self.kv_sparsity[layer] + kv_sparsity
        else:
            self.sparsity[layer], self.kv_sparsity[layer] = sparsity, kv_sparsity
        self.steps[layer] = self.steps.get(layer, 0) + 1
        if fail_safe is not None:
            fail_safe = fail_safe.detach()
            self.fail_safe = fail_safe if self.fail_safe is None else self.fail_safe + fail_safe.to(self.fail_safe)

    def merge(self, other: DecodeStatistics) -> None:
        """Add ``other``'s sums (e.g. from another run or process)."""
        for layer, steps in other.steps.items():
            if layer in self.sparsity:
                self.sparsity[layer] = self.sparsity[layer] + other.sparsity[layer].to(self.sparsity[layer])
                self.kv_sparsity[layer] = self.kv_sparsity[layer] + other.kv_sparsity[layer].to(
                    self.kv_sparsity[layer]
                )
            else:
                self.sparsity[layer], self.kv_sparsity[layer] = other.sparsity[layer], other.kv_sparsity[layer]
            self.steps[layer] = self.steps.get(layer, 0) + steps
        if other.fail_safe is not None:
            theirs = other.fail_safe
            self.fail_safe = theirs if self.fail_safe is None else self.fail_safe + theirs.to(self.fail_safe)

    def compute(self) -> dict[str, Any]:
        """Mean sparsity and kv_sparsity over all decoded (layer, step) pairs, per layer, and fail-safe count.

        Without any decode step the means are ``nan``.
        """
        layers = sorted(self.steps)
        per_layer = {layer: (self.sparsity[layer] / self.steps[layer]).item() for layer in layers}
        per_layer_kv = {layer: (self.kv_sparsity[layer] / self.steps[layer]).item() for layer in layers}
        steps = sum(self.steps.values())
        return {
            "decode_steps": max(self.steps.values(), default=0),
            "sparsity": sum(self.sparsity[layer].item() for layer in layers) / steps if steps else float("nan"),
            "kv_sparsity": sum(self.kv_sparsity[layer].item() for layer in layers) / steps if steps else float("nan"),
            "sparsity_per_layer": per_layer,
            "kv_sparsity_per_layer": per_layer_kv,
            "fail_safe": int(self.fail_safe.item()) if self.fail_safe is not None else 0,
        }
