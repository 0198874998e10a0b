"""Results: the JSON record of a configuration, a printed table, and the accuracy-vs-sparsity plot."""

from __future__ import annotations

import csv
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qada.eval._extra import pyplot
from qada.eval.results_file import read_rows, write_json

__all__ = [
    "fitted_on_markdown",
    "format_table",
    "markdown_table",
    "number_cell",
    "plot_score_vs_sparsity",
    "records_from_rows",
    "worst_case_drop",
    "result_record",
    "write_results",
]


def result_record(entry: dict, task: str, length: int | None, n: int, model: Any, seed: int, extra: dict | None = None):
    """One configuration's JSON result with everything needed to reproduce and compare it."""
    from qada.artifacts import model_fingerprint
    from qada.version import __version__

    criterion = entry["criterion"]
    return {
        "task": task,
        "length": length,
        "n": n,
        "label": entry["label"],
        "family": entry["family"],
        "criterion": criterion if isinstance(criterion, dict) else {"name": criterion},
        "moments": entry["moments"],
        "executor": entry["executor"],
        "window": entry["window"],
        "score": entry["score"],
        "sparsity": entry["sparsity"],
        "kv_sparsity": entry["kv_sparsity"],
        # over all layers, sliding-window layers (hybrid models) counted as local
        **{k: entry[k] for k in ("sparsity_all_layers", "kv_sparsity_all_layers", "kv_read") if k in entry},
        **{k: v for k, v in entry.items() if k.startswith("oracle_")},
        "decode_seconds": entry["decode_seconds"],
        "decode_tokens_per_s": entry.get("decode_tokens_per_s"),
        **({"missing": entry["missing"]} if entry.get("missing") else {}),
        "run": entry.get("run"),
        "model": model_fingerprint(model.config),
        "qada_version": __version__,
        "seed": seed,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **(extra or {}),
    }


def format_table(records: Sequence[dict]) -> str:
    """A plain-text table: task, length, configuration, score, sparsity, kv_sparsity, kv_read (the K/V a step
    reads over dense attention's, what the criterion reads to decide included), oracle agreement and the decode-only
    tokens per second (prefill and observers timed apart)."""
    header = (f"{'task':<16} {'len':>5} {'n':>3} {'configuration':<28} {'score':>6} {'sparsity':>8} {'kv_sp':>6} "
              f"{'kv_read':>7} {'agree':>6} {'dec tok/s':>9}")
    lines = [header, "-" * len(header)]
    for r in records:
        agree, rate = r.get("oracle_agreement"), r.get("decode_tokens_per_s")
        lines.append(
            f"{r['task']:<16} {r['length'] or 0:>5} {r['n']:>3} {r['label']:<28} {number_cell(r['score'], 1):>6} "
            f"{number_cell(r['sparsity'], 3):>8} {number_cell(r['kv_sparsity'], 3):>6} "
            f"{number_cell(r.get('kv_read'), 3):>7} {number_cell(agree, 3):>6} {number_cell(rate, 2):>9}"
        )
    return "\n".join(lines)


def number_cell(value: float | None, digits: int = 3) -> str:
    """A table cell: ``value`` with ``digits`` decimals, ``-`` when there is none (see the record's ``missing``)."""
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def markdown_table(records: Sequence[dict]) -> str:
    """A markdown table of the records (one row per task, length and configuration), kv_read included."""
    lines = ["| task | length | n | configuration | score | sparsity | kv_sparsity | kv_read |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['task']} | {r['length']} | {r['n']} | {r['label']} | {number_cell(r['score'], 1)} | "
                     f"{number_cell(r['sparsity'], 3)} | {number_cell(r['kv_sparsity'], 3)} | "
                     f"{number_cell(r.get('kv_read'), 3)} |")
    return "\n".join(lines)


def write_results(
    records: Sequence[dict], out_dir: str | Path, name: str = "results", command: str | None = None
) -> tuple[Path, Path]:
    """``name.json`` (all records), ``name.csv`` (the flat columns) and ``name.md`` (a table with the command
    that produced it) in ``out_dir``."""
    import sys

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = command or "qada " + " ".join(sys.argv[1:])
    (out / f"{name}.md").write_text(f"Produced by `{command}` (qada, {time.strftime('%Y-%m-%d')}).\n\n"
                                    + markdown_table(records) + "\n\nWorst case over tasks (paper §4):\n\n"
                                    + worst_case_markdown(worst_case_drop(records)) + "\n" + _fitted_section(records))
    json_path = write_json(out / f"{name}.json", list(records))
    csv_path = out / f"{name}.csv"
    columns = ["task", "length", "n", "family", "label", "score", "sparsity", "kv_sparsity", "sparsity_all_layers",
               "kv_sparsity_all_layers", "kv_read", "oracle_agreement", "decode_seconds", "decode_tokens_per_s"]
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    return json_path, csv_path


def fitted_on_markdown(records: Sequence[dict]) -> str:
    """A markdown table of what each calibration artifact behind the records was fitted on (``fitted_on``).

    One row per (task, length, family, file); ``""`` when no record used an artifact.
    """
    rows: dict[tuple, str] = {}
    for r in records:
        for entry in r.get("fitted_on") or ():
            info = "; ".join(f"{k}={_plain_value(v)}" for k, v in sorted(entry.get("info", {}).items()))
            key = (r["task"], r["length"], r["family"], entry.get("file"))
            rows[key] = (f"| {r['task']} | {r['length']} | {r['family']} | {entry.get('file')} "
                         f"({entry.get('kind', '?')}) | {info or 'nothing recorded'} |")
    if not rows:
        return ""
    return "\n".join(["| task | length | family | artifact | fitted on |", "|---|---:|---|---|---|", *rows.values()])


def _plain_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_plain_value(v) for v in value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_plain_value(v)}" for k, v in value.items()) + "}"
    return str(value).replace("|", "/")


def _fitted_section(records: Sequence[dict]) -> str:
    table = fitted_on_markdown(records)
    return f"\nWhat the calibration artifacts were fitted on:\n\n{table}\n" if table else ""


def plot_score_vs_sparsity(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Score vs sparsity (top row, paper Fig. 4/5) and score vs kv_read (bottom row: the K/V a step reads over
    dense attention's, what the criterion reads to decide included), one curve per configuration family and one
    column per (task, length)."""
    plt = pyplot()
    panels = sorted({(r["task"], r["length"]) for r in records}, key=lambda p: (p[0], p[1] or 0))
    fig, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 7.6), squeeze=False)
    for column, (task, length) in enumerate(panels):
        rows = [r for r in records if r["task"] == task and r["length"] == length]
        for row, (x, label) in enumerate((("sparsity", "sparsity (fraction of heads local)"),
                                          ("kv_read", "kv_read (K/V read over dense, deciding included)"))):
            ax = axes[row][column]
            for family in sorted({r["family"] for r in rows}):
                points = sorted((r[x], r["score"]) for r in rows
                                if r["family"] == family and r.get(x) is not None and r["score"] is not None)
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=family, linestyle="-" if len(points) > 1 else "none")
            ax.set_xlabel(label)
            ax.set_ylabel("score (0-100)")
            ax.set_title(f"{task} @ {length} tokens")
            ax.set_xlim(-0.02, 1.02)
            ax.set_ylim(-2, 102)
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mean_of(rows: list[dict], name: str) -> dict[str, float]:
    """``{name: mean}`` over the rows that have ``name`` (none where no row has it, e.g. older results)."""
    values = [r[name] for r in rows if r.get(name) is not None]
    return {name: sum(values) / len(values)} if values else {}


def records_from_rows(folder: str | Path) -> list[dict]:
    """Per-configuration records rebuilt from the per-sample ``results-rank*.jsonl`` under ``folder`` (recursively).

    The same means the evaluator computes (score, sparsity and kv_sparsity averaged over samples), for reporting
    a sweep that was interrupted; ``n`` is the number of samples each configuration finished.
    """
    import json

    groups: dict[tuple, list[dict]] = {}
    described: dict[tuple, dict] = {}  # (task, length, label) -> the cell's record of that label (cell.json)
    extras: dict[tuple, dict] = {}
    for path in sorted(Path(folder).rglob("results-rank*.jsonl")):
        cell_file = path.parent / "cell.json"
        cell = json.loads(cell_file.read_text()) if cell_file.is_file() else None
        # a sweep's folders are named <task>-<target length>; a sample's own length may fall a little short
        task_name, _, target = path.parent.name.rpartition("-")
        for row in read_rows(path):
            if cell is not None:  # written by run_sweep: the cell's own task and length (data files too)
                task, length = cell["task"], cell["length"]
                described[(task, length, row["config"])] = cell.get("configs", {}).get(row["config"], {})
                if "file" in cell.get("data", {}):
                    extras[(task, length, row["config"])] = {"data": cell["data"]}
            else:
                task = row["task"]
                length = int(target) if target.isdigit() and task_name == row["task"] else None
            groups.setdefault((task, length, row["config"]), []).append(row)
    records = []
    for (task, length, label), rows in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1] or 0)):
        measured = [r for r in rows if r["sparsity"] is not None]
        about = described.get((task, length, label), {})
        family = about.get("family") or ("dense" if label == "dense" else label.rsplit(" ", 1)[0])
        record = {
            "task": task, "length": length, "n": len(rows), "label": label, "family": family,
            "score": sum(r["score"] for r in rows) / len(rows),
            "sparsity": sum(r["sparsity"] for r in measured) / len(measured) if measured else None,
            "kv_sparsity": sum(r["kv_sparsity"] for r in measured) / len(measured) if measured else None,
            **_mean_of(measured, "kv_read"),
            "decode_seconds": sum(r["seconds"] for r in rows),
            "decode_tokens_per_s": _rate(sum(max(r.get("new_tokens", 1) - 1, 0) for r in rows),
                                         sum(r["seconds"] for r in rows)),
        }
        if not measured:
            record["missing"] = {"sparsity": _NO_DECODE, "kv_sparsity": _NO_DECODE}
        record.update(extras.get((task, length, label), {}))
        if about.get("fitted_on"):
            record["fitted_on"] = about["fitted_on"]
        records.append(record)
    return records


_NO_DECODE = "no decode step ran: every answer was one token, which comes from the dense prefill"


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens and seconds > 0 else None


def worst_case_drop(records: Sequence[dict]) -> list[dict]:
    """Per configuration: its mean sparsity and the largest score drop versus dense over all (task, length).

    The paper's worst-case view (§4): a criterion is only as good as its worst task.
    """
    dense = {(r["task"], r["length"]): r["score"] for r in records if r["family"] == "dense"}
    rows: dict[str, dict] = {}
    for r in records:
        key = (r["task"], r["length"])
        if r["family"] == "dense" or key not in dense:
            continue
        entry = rows.setdefault(r["label"], {"label": r["label"], "family": r["family"], "drops": [], "sparsity": []})
        if dense[key] is not None and r["score"] is not None:
            entry["drops"].append((dense[key] - r["score"], f"{r['task']}@{r['length']}"))
        if r["sparsity"] is not None:
            entry["sparsity"].append(r["sparsity"])
    out = []
    for entry in rows.values():
        if not entry["drops"] or not entry["sparsity"]:
            continue  # nothing measured to compare
        drop, where = max(entry["drops"])
        out.append({"label": entry["label"], "family": entry["family"], "worst_drop": drop, "worst_task": where,
                    "mean_sparsity": sum(entry["sparsity"]) / len(entry["sparsity"]), "cells": len(entry["drops"])})
    return sorted(out, key=lambda e: (e["family"], e["mean_sparsity"]))


def worst_case_markdown(rows: Sequence[dict]) -> str:
    lines = ["| configuration | mean sparsity | worst drop vs dense | where | (task, length) cells |",
             "|---|---:|---:|---|---:|"]
    lines += [f"| {r['label']} | {r['mean_sparsity']:.3f} | {r['worst_drop']:.1f} | {r['worst_task']} | {r['cells']} |"
              for r in rows]
    return "\n".join(lines)
