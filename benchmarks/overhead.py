"""QAdA's own cost per layer and decode step, as a fraction of dense attention at the same ``T``.

Parts timed separately, on one layer's tensors (``query [b, H, 1, d]``, cache ``[b, H_kv, T, d]``):

* ``criterion``: ``StepContext`` + ``QAdACriterion`` with given moments (mean ``[b, H_kv, d]``, cov
  ``[b, H_kv, d, d]``), i.e. window scores, log A_local, the lognormal estimate and the decision;
* ``current_update``: ``CurrentMoments.append`` of one key on a growing cache + ``moments()`` (float64 Welford
  state -> float32 mean/cov);
* ``stored_lookup``: ``StoredMoments.moments()`` as the cache grows by one (rank-1 move of the reference range).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.attention import Shape
from benchmarks.common import measure
from qada.criteria import DecodeStep, QAdACriterion
from qada.moments import CurrentMoments, StoredMoments
from qada.moments.reference import ReferenceKeys
from qada.step import BulkMoments
from qada.window import Window

__all__ = ["run_overhead"]


def run_overhead(shapes: list[Shape], lengths: list[int], device, reps: int, inner: int, log=print) -> list[dict]:
    window = Window()
    rows = []
    for shape in shapes:
        for T in lengths:
            rows.append(_one(shape, T, device, reps, inner, window))
            r = rows[-1]
            log(
                f"  overhead {shape.name} T={T}: dense {r['dense_attention'].ms()} ms, criterion "
                f"{r['criterion'].ms()} ms, current {r['current_update'].ms()} ms, stored "
                f"{r['stored_lookup'].ms()} ms -> stored {100 * r['fraction_stored']:.1f}%, current "
                f"{100 * r['fraction_current']:.1f}% of dense"
            )
    return rows


def _one(shape: Shape, T: int, device, reps: int, inner: int, window: Window) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(1)
    steps = 2 + reps * inner + 2  # warmup + timed calls, each one longer
    total = T + steps
    q = torch.randn(shape.b, shape.H, 1, shape.d, generator=g).to(device, shape.dtype)
    keys = torch.randn(shape.b, shape.H_kv, total, shape.d, generator=g).to(device, shape.dtype)
    values = torch.randn(shape.b, shape.H_kv, T, shape.d, generator=g).to(device, shape.dtype)
    scale = shape.d**-0.5
    k_T = keys[:, :, :T]

    dense = measure(
        lambda: F.scaled_dot_product_attention(q, k_T, values, scale=scale, enable_gqa=True),
        device, reps=reps, warmup=2, inner=inner,
    )  # fmt: skip

    bulk = k_T[:, :, window.t_sink : T - window.t_recent].double()
    mean = bulk.mean(2)
    centred = bulk - mean[:, :, None]
    cov = centred.transpose(-1, -2) @ centred / bulk.shape[2]
    moments = BulkMoments(mean.float(), cov.float())
    criterion = QAdACriterion(tau=0.6)

    def decide():
        step = DecodeStep(q[:, :, 0], k_T, scale, window, moments=moments)
        return criterion(step)

    criterion_t = measure(decide, device, reps=reps, warmup=2, inner=inner)

    current = CurrentMoments()
    current.prefill(0, keys[:, :, :T], None, window)
    length = [T]

    def current_step():
        length[0] += 1
        view = keys[:, :, : length[0]]
        current.append(0, view, None, window)
        return current.moments(0, view, None, window)

    current_t = measure(current_step, device, reps=reps, warmup=2, inner=inner)

    reference = ReferenceKeys(keys[None, 0].detach().to("cpu", torch.float16).clone())
    stored = StoredMoments()
    stored.set_reference(reference)
    stored.moments(0, keys[:, :, :T], None, window)  # the one-off jump from an empty range (a new prefill)
    stored_length = [T]

    def stored_step():
        stored_length[0] += 1
        return stored.moments(0, keys[:, :, : stored_length[0]], None, window)

    stored_t = measure(stored_step, device, reps=reps, warmup=2, inner=inner)
    base = dense["median"]
    return {
        "shape": shape.name,
        "T": T,
        "dtype": str(shape.dtype).replace("torch.", ""),
        "dense_attention": dense,
        "criterion": criterion_t,
        "current_update": current_t,
        "stored_lookup": stored_t,
        "fraction_criterion": criterion_t["median"] / base,
        "fraction_current": (criterion_t["median"] + current_t["median"]) / base,
        "fraction_stored": (criterion_t["median"] + stored_t["median"]) / base,
    }
