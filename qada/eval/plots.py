"""matplotlib figures of the analyses (PNG); every figure's numbers are also written as JSON by the caller."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from qada.eval._extra import pyplot as _pyplot

__all__ = ["plot_curves", "plot_head_maps"]


def plot_head_maps(maps: Mapping[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """One ``[L, H]`` heat map per entry (e.g. oracle vs QAdA long-context frequency), shared colour scale."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(maps), figsize=(3.2 * len(maps) + 1.5, 6), squeeze=False, constrained_layout=True)
    image = None
    for ax, (name, values) in zip(axes[0], maps.items(), strict=True):
        image = ax.imshow(values, aspect="auto", vmin=0, vmax=1, cmap="viridis")
        ax.set_title(name)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    if title:
        fig.suptitle(title, fontsize=9)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(x: Sequence[float], curves: Mapping[str, Sequence[float]], xlabel: str, ylabel: str,
                path: str | Path, title: str = "") -> Path:
    """Line plot of several named curves over a shared x."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for name, ys in curves.items():
        ax.plot(x, ys, marker="o", markersize=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
