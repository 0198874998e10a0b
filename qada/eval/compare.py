"""An honest comparison of sweep results: per family, the mean score over an interval and who wins where, on two
axes: head sparsity (the paper's; higher is sparser) and kv_read (the K/V a decode step reads over dense
attention's, the criterion's own reads included; what decoding time follows, lower is cheaper).

Every number comes from the family's measured points, interpolated piecewise-linearly along the axis (points sorted
by it; points at the same value averaged). Nothing is extrapolated: a family whose points do not reach both ends of
the interval has no area (``None``, with how much of the interval it covers), and outside a family's points that
family does not compete.

The report (:func:`write_comparison`, ``qada analyze --compare results.json --out DIR``): ``comparison.png``
(score against sparsity, against kv_sparsity and against kv_read, one panel per (task, length), every point
labelled with its tau / alpha / budget), ``comparison.md`` and ``comparison.json`` (the same numbers, one row per
cell and axis).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "AUC_RANGE",
    "KV_READ_RANGE",
    "cells",
    "comparison",
    "comparison_markdown",
    "curve_points",
    "dominance",
    "interpolate",
    "mean_score",
    "place_labels",
    "plot_comparison",
    "point_tag",
    "sparsity_grid",
    "write_comparison",
]

#: The sparsity interval of the mean score (paper §4: the interesting regime is sparsity >= 0.7).
AUC_RANGE = (0.7, 0.95)

#: The kv_read interval of the mean score: a step reading a tenth to a half of dense attention's K/V.
KV_READ_RANGE = (0.1, 0.5)

Point = tuple[float, float]


def curve_points(points: Iterable[Point]) -> list[Point]:
    """``(x, y)`` points sorted by x, points with the same x averaged (a function to interpolate)."""
    grouped: dict[float, list[float]] = {}
    for x, y in points:
        if x is None or y is None:
            continue
        grouped.setdefault(float(x), []).append(float(y))
    return [(x, sum(ys) / len(ys)) for x, ys in sorted(grouped.items())]


def interpolate(points: Sequence[Point], x: float) -> float | None:
    """The piecewise-linear value at ``x`` of :func:`curve_points`-ordered points; ``None`` outside them."""
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]  # a single point exactly at x


def mean_score(points: Iterable[Point], lo: float = AUC_RANGE[0], hi: float = AUC_RANGE[1],
               axis: str = "sparsity") -> dict[str, Any]:
    """The area under the piecewise-linear curve over ``[lo, hi]``, divided by ``hi - lo`` (a mean score).

    Returns ``{"mean_score", "coverage", "covered", "reason"}``: ``coverage`` is the fraction of ``[lo, hi]``
    the points span, ``covered`` that span (``None`` if they miss the interval); ``mean_score`` is ``None``
    (with the ``reason``) unless the points reach both ends: nothing is extrapolated.
    """
    if not hi > lo:
        raise ValueError(f"expected an interval lo < hi but got [{lo}, {hi}]")
    curve = curve_points(points)
    if not curve:
        return {"mean_score": None, "coverage": 0.0, "covered": None, "reason": "no measured points"}
    start, end = max(lo, curve[0][0]), min(hi, curve[-1][0])
    coverage = max(0.0, end - start) / (hi - lo)
    covered = [round(start, 4), round(end, 4)] if end >= start else None
    if curve[0][0] > lo or curve[-1][0] < hi:
        span = f"{curve[0][0]:.3f}" if len(curve) == 1 else f"[{curve[0][0]:.3f}, {curve[-1][0]:.3f}]"
        reason = (f"points span {axis} {span}: {coverage:.0%} of [{lo}, {hi}]"
                  + (f" (covered {covered[0]:.3f}-{covered[1]:.3f})" if covered and coverage > 0 else ""))
        return {"mean_score": None, "coverage": coverage, "covered": covered, "reason": reason}
    xs = [lo] + [x for x, _ in curve if lo < x < hi] + [hi]
    ys = [interpolate(curve, x) for x in xs]
    area = sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False))
    return {"mean_score": area / (hi - lo), "coverage": coverage, "covered": covered, "reason": None}


def sparsity_grid(lo: float = AUC_RANGE[0], hi: float = AUC_RANGE[1], step: float = 0.05) -> list[float]:
    """``lo, lo + step, ..., hi`` rounded to 4 decimals (``0.7, 0.75, ..., 0.95``)."""
    count = int(round((hi - lo) / step))
    return [round(lo + i * step, 4) for i in range(count + 1)]


def dominance(curves: Mapping[str, Iterable[Point]], grid: Sequence[float], tolerance: float = 1e-9) -> list[dict]:
    """At every grid point of the axis: the family (or tied families) with the highest interpolated score.

    Only families whose points span the grid point compete; ``best`` is empty and ``score`` ``None`` where none
    does. Returns ``[{"sparsity", "best": [families], "score", "competing": {family: score}}]`` (``"sparsity"``:
    the grid point, whatever the axis).
    """
    ordered = {family: curve_points(points) for family, points in curves.items()}
    out = []
    for x in grid:
        competing = {f: v for f, points in ordered.items() if (v := interpolate(points, x)) is not None}
        top = max(competing.values(), default=None)
        best = sorted(f for f, v in competing.items() if top is not None and v >= top - tolerance)
        out.append({"sparsity": x, "best": best, "score": top, "competing": competing})
    return out


def point_tag(record: Mapping[str, Any]) -> str:
    """The short text next to a point: its label without the family (``tau=0.6``, ``alpha=0.5``, ...)."""
    label, family = str(record.get("label", "")), str(record.get("family", ""))
    tag = label[len(family):].strip() if family and label.startswith(family) else label
    for long, short in (("tau=", "τ"), ("alpha=", "α")):
        tag = tag.replace(long, short)
    return tag


def cells(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, int | None]]:
    """The (task, length) cells of the records, sorted."""
    return sorted({(r["task"], r["length"]) for r in records}, key=lambda c: (c[0], c[1] or 0))


def _family_points(records: Sequence[Mapping[str, Any]], cell: tuple, x: str = "sparsity") -> dict[str, list]:
    families: dict[str, list] = {}
    for r in records:
        if (r["task"], r["length"]) == cell and r.get(x) is not None and r.get("score") is not None:
            families.setdefault(r["family"], []).append((r[x], r["score"]))
    return families


def comparison(
    records: Sequence[Mapping[str, Any]], lo: float = AUC_RANGE[0], hi: float = AUC_RANGE[1], step: float = 0.05,
    axis: str = "sparsity",
) -> list[dict]:
    """Per (task, length): every family's :func:`mean_score` over ``[lo, hi]`` and the :func:`dominance` on the
    grid ``lo, lo + step, ..., hi``, score against ``axis`` (``"sparsity"`` or ``"kv_read"``)."""
    grid = sparsity_grid(lo, hi, step)
    out = []
    for cell in cells(records):
        families = _family_points(records, cell, axis)
        out.append({
            "task": cell[0], "length": cell[1], "axis": axis, "range": [lo, hi],
            "families": {f: {**mean_score(points, lo, hi, axis), "points": len(points)}
                         for f, points in sorted(families.items())},
            "dominance": dominance(families, grid),
        })
    return out


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def comparison_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown of :func:`comparison`: the mean-score table and, per cell, who dominates at each grid point."""
    if not rows:
        return "No results to compare.\n"
    lo, hi = rows[0]["range"]
    axis = rows[0].get("axis", "sparsity")
    lines = [f"### Mean score over {axis} [{lo}, {hi}]", "",
             f"Area under the score-vs-{axis} curve (piecewise-linear between measured points) divided by the "
             "interval's width; `-` where the family's points do not span the interval (nothing is extrapolated)."
             + (" kv_read counts what a step reads, the criterion's own reads included: lower is cheaper."
                if axis == "kv_read" else ""),
             "", "| task | length | family | points | mean score | coverage | note |",
             "|---|---:|---|---:|---:|---:|---|"]
    for row in rows:
        for family, entry in row["families"].items():
            lines.append(f"| {row['task']} | {row['length']} | {family} | {entry['points']} | "
                         f"{_score(entry['mean_score'])} | {entry['coverage']:.0%} | {entry['reason'] or ''} |")
    lines += ["", f"### Who dominates where ({axis})", "",
              f"Highest interpolated score at each {axis} (families whose points span it; ties listed).", ""]
    grid = [d["sparsity"] for d in rows[0]["dominance"]]
    lines.append("| task | length | " + " | ".join(f"{x:g}" for x in grid) + " |")
    lines.append("|---|---:|" + "---|" * len(grid))
    for row in rows:
        entries = [", ".join(d["best"]) + f" ({_score(d['score'])})" if d["best"] else "-" for d in row["dominance"]]
        lines.append(f"| {row['task']} | {row['length']} | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


#: Candidate label offsets in points (right, above-right, below-right, left, ...), tried in order.
_OFFSETS = ((5, 3), (5, -9), (-5, 3), (-5, -9), (5, 11), (5, -17), (-5, 11), (-5, -17), (12, -3), (-12, -3))


def place_labels(
    anchors: Sequence[tuple[float, float]],
    sizes: Sequence[tuple[float, float]],
    offsets: Sequence[tuple[float, float]] = _OFFSETS,
    bounds: tuple[float, float, float, float] | None = None,
) -> list[tuple[float, float]]:
    """Greedy label placement: for each anchor (in order), the first offset whose box overlaps no placed box.

    ``anchors`` and ``sizes`` are in the same units as ``offsets`` (points); a label with a negative x offset is
    right-aligned at the offset (its box extends to the left). The markers themselves (a 4-point square around
    each anchor) are obstacles too, and so is everything outside ``bounds`` (``(x0, y0, x1, y1)``, e.g. the
    axes). If every offset collides, the one with the least overlap is taken. Returns one offset per anchor.
    """
    placed: list[tuple[float, float, float, float]] = [(x - 2, y - 2, x + 2, y + 2) for x, y in anchors]

    def box(anchor, size, offset):
        x, y = anchor[0] + offset[0], anchor[1] + offset[1]
        left = x - size[0] if offset[0] < 0 else x
        return (left, y, left + size[0], y + size[1])

    def overlap(a, b):
        return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))

    def outside(b):
        if bounds is None:
            return 0.0
        inside = overlap(b, bounds)
        return 10.0 * ((b[2] - b[0]) * (b[3] - b[1]) - inside)  # worse than covering another label

    chosen = []
    for anchor, size in zip(anchors, sizes, strict=True):
        costs = [(sum(overlap(box(anchor, size, o), p) for p in placed) + outside(box(anchor, size, o)), i)
                 for i, o in enumerate(offsets)]
        _, best = min(costs)
        chosen.append(offsets[best])
        placed.append(box(anchor, size, offsets[best]))
    return chosen


def plot_comparison(
    records: Sequence[Mapping[str, Any]], path: str | Path, title: str = "", span: tuple[float, float] = AUC_RANGE
) -> Path:
    """Score against sparsity (top row), against kv_sparsity (middle row) and against kv_read (bottom row), one
    column per (task, length), one curve per family, every point labelled with :func:`point_tag` (placed by
    :func:`place_labels`); the sparsity interval ``span`` and the kv_read interval :data:`KV_READ_RANGE` of
    :func:`mean_score` are shaded."""
    from qada.eval._extra import pyplot

    plt = pyplot()
    panels = cells(records)
    fig, axes = plt.subplots(3, max(1, len(panels)), figsize=(6.0 * max(1, len(panels)), 13.5), squeeze=False)
    families = sorted({r["family"] for r in records})
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    fontsize = 6
    pending = []  # (axis, [(x, score, tag, colour)]): labelled once the layout is final
    for column, cell in enumerate(panels):
        for row, x in enumerate(("sparsity", "kv_sparsity", "kv_read")):
            ax = axes[row][column]
            texts = []
            for family in families:
                rows = sorted((r for r in records if (r["task"], r["length"]) == cell and r["family"] == family
                               and r.get(x) is not None and r.get("score") is not None), key=lambda r: r[x])
                if not rows:
                    continue
                xs, ys = [r[x] for r in rows], [r["score"] for r in rows]
                if family == "dense":
                    ax.axhline(ys[0], color=colors[family], linestyle=":", linewidth=1)
                ax.plot(xs, ys, marker="o", markersize=3.5, color=colors[family], label=family,
                        linestyle="-" if len(rows) > 1 else "none", linewidth=1.2)
                texts += [(r[x], r["score"], point_tag(r), colors[family]) for r in rows if point_tag(r)]
            ax.set_xlim(-0.02, 1.02)
            ax.set_ylim(-4, 106)
            ax.set_xlabel({"sparsity": "sparsity (fraction of heads local)",
                           "kv_sparsity": "kv_sparsity (fraction of KV groups local)",
                           "kv_read": "kv_read (K/V read over dense attention's, deciding included)"}[x])
            ax.set_ylabel("score (0-100)")
            ax.set_title(f"{cell[0]} @ {cell[1]} tokens")
            if x == "sparsity":
                ax.axvspan(*span, color="0.93", zorder=0)
            elif x == "kv_read":
                ax.axvspan(*KV_READ_RANGE, color="0.93", zorder=0)
            ax.grid(alpha=0.3)
            pending.append((ax, texts))
    handles = {}
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(name, handle)
    if handles:  # one legend for every family of every panel
        fig.legend(list(handles.values()), list(handles), loc="upper center", ncol=min(len(handles), 6), fontsize=8,
                   frameon=False)
    if title:
        fig.suptitle(title, y=1.0)
    rows_of_legend = (len(handles) + 5) // 6
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.03 * rows_of_legend))
    for ax, texts in pending:
        anchors = [tuple(ax.transData.transform((tx, ty)) * 72.0 / fig.dpi) for tx, ty, _, _ in texts]
        sizes = [(0.6 * fontsize * len(tag), fontsize) for _, _, tag, _ in texts]
        box = ax.get_window_extent()
        bounds = (box.x0 * 72.0 / fig.dpi, box.y0 * 72.0 / fig.dpi, box.x1 * 72.0 / fig.dpi, box.y1 * 72.0 / fig.dpi)
        for (dx, dy), (tx, ty, tag, color) in zip(place_labels(anchors, sizes, bounds=bounds), texts, strict=True):
            ax.annotate(tag, (tx, ty), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                        color=color, ha="right" if dx < 0 else "left", va="bottom")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_comparison(
    records: Sequence[Mapping[str, Any]], out_dir: str | Path, lo: float = AUC_RANGE[0], hi: float = AUC_RANGE[1],
    step: float = 0.05, command: str | None = None, name: str = "comparison",
) -> tuple[Path, Path, Path]:
    """``comparison.md``, ``comparison.json`` (:func:`comparison` over sparsity ``[lo, hi]`` and over kv_read
    :data:`KV_READ_RANGE`, one row per cell and axis) and ``comparison.png`` (:func:`plot_comparison`) in
    ``out_dir``; the markdown also lists what each calibration artifact was fitted on."""
    import time

    from qada.eval.report import fitted_on_markdown
    from qada.eval.results_file import write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = comparison(records, lo, hi, step)
    read_rows = comparison(records, *KV_READ_RANGE, step, axis="kv_read")
    header = f"Produced by `{command}` (qada, {time.strftime('%Y-%m-%d')}).\n\n" if command else ""
    fitted = fitted_on_markdown(records)
    md = out / f"{name}.md"
    md.write_text(header + comparison_markdown(rows) + "\n" + comparison_markdown(read_rows)
                  + (f"\n### What the calibration artifacts were fitted on\n\n{fitted}\n" if fitted else ""))
    json_path = write_json(out / f"{name}.json", rows + read_rows)
    png = plot_comparison(records, out / f"{name}.png", span=(lo, hi))
    return md, json_path, png
