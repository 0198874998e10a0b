"""Decode attention alone: each qada executor at forced sparsity vs dense ``scaled_dot_product_attention``.

``local`` is built so that a chosen number of whole KV groups is local (all ``G`` query heads of the group) and
the other groups are dense: ``rho_kv`` = fraction of KV groups whose bulk is skipped.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import graphed, measure
from qada.attention import EXECUTORS, decode_attention
from qada.step import DecodeStep
from qada.window import Window

__all__ = ["Shape", "copy_bandwidth", "dense_launch_sweep", "graph_call", "group_local_mask", "run_attention"]


@dataclass(frozen=True)
class Shape:
    name: str
    b: int
    H: int
    H_kv: int
    d: int
    dtype: torch.dtype


SMOLLM2 = Shape("smollm2", 1, 9, 3, 64, torch.float32)
LLAMA8B_F32 = Shape("llama3-8b-layer-f32", 1, 32, 8, 128, torch.float32)
LLAMA8B_BF16 = Shape("llama3-8b-layer", 1, 32, 8, 128, torch.bfloat16)
LLAMA8B_BF16_B8 = Shape("llama3-8b-layer-b8", 8, 32, 8, 128, torch.bfloat16)


def group_local_mask(shape: Shape, local_groups: int, device: torch.device | str) -> torch.Tensor:
    """``[b, H]`` bool: the first ``local_groups`` KV groups entirely local, the others entirely dense."""
    G = shape.H // shape.H_kv
    group_is_local = torch.arange(shape.H_kv, device=device) < local_groups
    return group_is_local.repeat_interleave(G)[None, :].expand(shape.b, shape.H).contiguous()


def kv_bytes(shape: Shape, T: int, local_groups: int, window: Window) -> int:
    """Bytes of K and V an ideal kernel reads: the whole cache of dense groups, the window of local ones."""
    element = torch.finfo(shape.dtype).bits // 8
    tokens = (shape.H_kv - local_groups) * T + local_groups * min(T, window.t_local)
    return 2 * shape.b * tokens * shape.d * element


def copy_bandwidth(device: torch.device | str, nbytes: int, reps: int) -> dict[str, Any]:
    """Bytes/s of ``dst.copy_(src)`` on a ``nbytes`` tensor (counting the read and the write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), device, reps=reps, warmup=2)
    return {"bytes": 2 * nbytes, "timing": timing, "bandwidth_gbs": 2 * nbytes / timing["median"] / 1e9}


def _rho_list(shape: Shape) -> list[int]:
    """Numbers of local KV groups to force: 0, ~H_kv/2, ~7/8 H_kv (distinct, < H_kv), all."""
    wanted = [0, round(0.5 * shape.H_kv), round(0.875 * shape.H_kv), shape.H_kv]
    if shape.H_kv == 3:  # SmolLM2: 0.5 and 0.875 are not reachable with 3 groups; take 1/3 and 2/3
        wanted = [0, 1, 2, 3]
    return sorted(set(wanted))


def build_executor(name: str, flex_compile: bool | None):
    if name == "flex":
        return EXECUTORS.build({"name": "flex", "compile": flex_compile})
    return EXECUTORS.build(name)


def run_attention(
    shapes: list[Shape],
    lengths: list[int],
    executors: list[str],
    device: torch.device | str,
    reps: int,
    inner: int = 1,
    flex_compile: bool | None = None,
    log=print,
    local_groups: list[int] | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per (shape, T, executor, local groups): time per call, ratio to dense SDPA, bytes, bandwidth.
    ``local_groups``: the numbers of KV groups forced local (default: none, about half, 7/8 and all of them).
    ``rows``: a list the rows are appended to as they are measured (an interrupted run keeps them), returned."""
    window = Window()
    rows = [] if rows is None else rows
    built = {name: build_executor(name, flex_compile) for name in executors}
    for shape in shapes:
        for T in lengths:
            g = torch.Generator(device="cpu").manual_seed(0)
            q = torch.randn(shape.b, shape.H, 1, shape.d, generator=g).to(device, shape.dtype)
            k = torch.randn(shape.b, shape.H_kv, T, shape.d, generator=g).to(device, shape.dtype)
            v = torch.randn(shape.b, shape.H_kv, T, shape.d, generator=g).to(device, shape.dtype)
            scale = shape.d**-0.5

            def dense(q=q, k=k, v=v, scale=scale):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

            dense_t = measure(dense, device, reps=reps, warmup=2, inner=inner)
            dense_bytes = kv_bytes(shape, T, 0, window)
            rows.append(_row(shape, T, "dense_sdpa", 0, dense_t, dense_t, dense_bytes, None)
                        | _graphed(dense, device, reps, inner, dense_bytes))
            log(f"  attention {shape.name} T={T} dense_sdpa {dense_t.ms()} ms")
            for forced in (_rho_list(shape) if local_groups is None else local_groups):
                local = group_local_mask(shape, forced, device)
                expected = None
                for name, executor in built.items():

                    def call(executor=executor, local=local, q=q, k=k, v=v, scale=scale):
                        return decode_attention(executor, q, k, v, local, window, scale)

                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            out = call()
                            if expected is None:
                                reference = EXECUTORS.build("reference")
                                expected = decode_attention(reference, q, k, v, local, window, scale).output.float()
                            error = (out.output.float() - expected).abs().max().item()
                            timing = measure(call, device, reps=reps, warmup=2, inner=inner)
                    except Exception as exc:  # one executor failing must not lose the others' numbers
                        rows.append({"shape": shape.name, "T": T, "executor": name, "error": repr(exc)[:300]})
                        log(f"  attention {shape.name} T={T} {name} FAILED: {exc!r}"[:300])
                        continue
                    row = _row(shape, T, name, forced, timing, dense_t, kv_bytes(shape, T, forced, window),
                               error)  # fmt: skip
                    row["kv_sparsity_reported"] = float(out.kv_sparsity)
                    if getattr(executor, "static_shapes", False):
                        captured, row["graphed_call"] = graph_call(executor, forced, q, k, v, local, window, scale)
                        row |= _graphed(captured, device, reps, inner, row["kv_bytes_ideal"])
                    rows.append(row)
                    log(
                        f"  attention {shape.name} T={T} {name} rho_kv={row['rho_kv']:.3f} {timing.ms()} ms "
                        f"x{row['speedup_vs_dense']:.2f} vs dense"
                    )
            del q, k, v
    return rows


def graph_call(executor: Any, forced: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, local: torch.Tensor,
               window: Window, scale: float) -> tuple[Any, str]:
    """``(call, name)``: what a graph-captured row of ``executor`` captures, as a run's decode step runs it. With
    every group dense (``forced == 0``) on an executor with ``attend_dense`` (``triton``: its two launches,
    ``sdpa``): the dense step alone (:mod:`qada.models.dense_step`, what qada's all-dense path runs), the step built
    outside the graph; else :func:`~qada.attention.decode_attention`, the executor's group policy and sparsities
    included (in a run the layer step computes those)."""
    if forced == 0 and callable(getattr(executor, "attend_dense", None)):
        step = DecodeStep.from_attention(q, k, v, window, scale)
        return (lambda: executor.attend_dense(step)[0]), "attend_dense"
    return (lambda: decode_attention(executor, q, k, v, local, window, scale)), "decode_attention"


def dense_launch_sweep(shapes: list[Shape], lengths: list[int], device: torch.device | str, reps: int,
                       inner: int = 1, log=print, rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """CUDA only: the ``triton`` executor's dense step (``attend_dense``: its two launches, as qada's all-dense path
    runs them), graph-captured, over its launch parameters
    (``block_size`` 64 / 128, ``num_splits`` auto / ~4 / ~8 programs per SM, ``num_warps`` 4 / 8, ``num_stages`` 2 /
    3), at every ``T >= 32768`` of ``lengths``: one row per setting with its bandwidth, so that a GPU run shows how
    close the executor's dense path gets to copy bandwidth and which setting gets there. Empty on the CPU. ``rows``:
    as :func:`run_attention`'s."""
    if torch.device(device).type != "cuda":
        return []
    window = Window()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = [] if rows is None else rows
    for shape in shapes:
        for T in [t for t in lengths if t >= 32768]:
            g = torch.Generator(device="cpu").manual_seed(0)
            q = torch.randn(shape.b, shape.H, 1, shape.d, generator=g).to(device, shape.dtype)
            k = torch.randn(shape.b, shape.H_kv, T, shape.d, generator=g).to(device, shape.dtype)
            v = torch.randn(shape.b, shape.H_kv, T, shape.d, generator=g).to(device, shape.dtype)
            local = group_local_mask(shape, 0, device)
            nbytes = kv_bytes(shape, T, 0, window)
            pairs = shape.b * shape.H_kv
            for block in (64, 128):
                for splits in (None, -(-4 * sms // pairs), -(-8 * sms // pairs)):
                    for warps in (4, 8):
                        for stages in (2, 3):
                            setting = {"name": "triton", "block_size": block, "num_splits": splits,
                                       "num_warps": warps, "num_stages": stages}  # fmt: skip
                            executor = EXECUTORS.build(setting)

                            call, how = graph_call(executor, 0, q, k, v, local, window, shape.d**-0.5)
                            row = {"shape": shape.name, "b": shape.b, "T": T, "setting": setting, "graphed_call": how,
                                   "kv_bytes_ideal": nbytes} | _graphed(call, device, reps, inner, nbytes)
                            rows.append(row)
                            if "graphed_bandwidth_gbs" in row:
                                log(f"  dense sweep {shape.name} T={T} {setting}: {row['graphed_bandwidth_gbs']:.0f} "
                                    "GB/s")
            del q, k, v
    return rows


def _graphed(call, device, reps: int, inner: int, nbytes: int) -> dict[str, Any]:
    """On CUDA, ``call`` captured in a CUDA graph and timed by replays (the kernels alone, as inside a captured
    decode step): ``graphed_timing`` and ``graphed_bandwidth_gbs``, or ``graphed_error``. Nothing on the CPU."""
    if torch.device(device).type != "cuda":
        return {}
    try:
        timing = measure(graphed(call, device), device, reps=reps, warmup=2, inner=inner)
    except Exception as exc:  # noqa: BLE001 - a path that cannot be captured still has its eager timing
        return {"graphed_error": repr(exc)[:300]}
    return {"graphed_timing": timing, "graphed_bandwidth_gbs": nbytes / timing["median"] / 1e9}


def _row(shape, T, name, local_groups, timing, dense_t, nbytes, error) -> dict[str, Any]:
    return {
        "shape": shape.name,
        "b": shape.b,
        "H": shape.H,
        "H_kv": shape.H_kv,
        "d": shape.d,
        "dtype": str(shape.dtype).replace("torch.", ""),
        "T": T,
        "executor": name,
        "local_groups": local_groups,
        "rho_kv": local_groups / shape.H_kv,
        "timing": timing,
        "dense_timing": dense_t,
        "speedup_vs_dense": dense_t["median"] / timing["median"],
        "kv_bytes_ideal": nbytes,
        "bandwidth_gbs": nbytes / timing["median"] / 1e9,
        "max_abs_err_vs_reference": error,
    }
