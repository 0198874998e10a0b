"""Timing helpers, machine description and result writing shared by the benchmark modules."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["Timing", "device_sync", "greedy_decode", "machine_info", "measure", "write_results"]


def device_sync(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Timing(dict):
    """Seconds per call: ``median``, ``min``, ``max``, ``reps`` and every repetition in ``times``."""

    @classmethod
    def of(cls, times: list[float]) -> Timing:
        return cls(median=statistics.median(times), min=min(times), max=max(times), reps=len(times), times=times)

    def ms(self) -> str:
        """``median ms [min-max]``."""
        return f"{1e3 * self['median']:.3f} [{1e3 * self['min']:.3f}-{1e3 * self['max']:.3f}]"


def measure(
    fn: Callable[[], Any],
    device: torch.device | str = "cpu",
    reps: int = 5,
    warmup: int = 1,
    inner: int = 1,
) -> Timing:
    """Median seconds per call of ``fn`` over ``reps`` repetitions of ``inner`` calls each, after ``warmup`` calls.

    On CUDA each repetition is timed by CUDA events around the ``inner`` calls (after a synchronize); on the
    CPU by :func:`time.perf_counter`.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    device_sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) / inner)
    return Timing.of(times)


def graphed(fn: Callable[[], Any], device: torch.device | str) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph (after three warm-up calls on a side stream): the returned callable replays
    it, so a timing measures the kernels, not Python dispatch. On the CPU ``fn`` itself (nothing to capture)."""
    device = torch.device(device)
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def greedy_decode(model: Any, ids: torch.Tensor, steps: int, capacity: int,
                  around: Callable[[int], contextlib.AbstractContextManager] | None = None) -> None:
    """Prefill ``ids [1, T]`` into a fresh ``StaticCache`` of ``capacity`` slots and decode ``steps`` greedy tokens
    (no gradients), each decode step's forward inside ``around(step)`` (a context manager, made just before it; the
    place to record, count or clear for that step). Whatever is attached to ``model`` runs as it is."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=capacity)
    with torch.no_grad():
        mask = torch.ones_like(ids)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for step in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            with around(step) if around is not None else contextlib.nullcontext():
                out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)


def keep_first_layers(model: Any, layers: int) -> int:
    """Cut a transformers decoder to its first ``layers`` layers (the dry run: the real model's code path at a tiny
    cost); returns how many it had."""
    total = model.config.num_hidden_layers
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return total


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """CPU model, cores, torch threads, GPU name, library versions and the date."""
    import transformers

    import qada
    from qada.moments.reference import processor_name

    device = torch.device(device)
    info: dict[str, Any] = {
        "cpu": processor_name(torch.device("cpu")),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": None,
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "qada": getattr(qada, "__version__", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def machine_tag(info: dict[str, Any]) -> str:
    """A short file-name tag for the machine: ``cpu`` or the GPU's name (``h100``, ``h200``, ...)."""
    if not info.get("gpu"):
        return "cpu"
    name = info["gpu"].lower()
    for tag in ("h200", "h100", "a100", "l40s", "l4", "a10"):
        if tag in name:
            return tag
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def write_results(out_dir: str | os.PathLike, stem: str, results: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` under ``out_dir``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1, default=_jsonable) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
