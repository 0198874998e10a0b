"""Issue 16's comparison: every criterion family on niah_single_1, niah_single_2 and niah_multikey_1 at 2k and 4k.

Evaluation prompts come from qada's RULER generators with seed 7; every calibration artifact (the static head
set, the hybrid's always-dense heads, calibrated QAdA's correction) is fitted on *other* tasks (niah_single_3,
niah_multikey_2, vt) with seed 100, so no evaluated prompt or task was seen by a calibration. Per-sample rows
resume (identity-checked), so the command can be rerun to add families or finish an interrupted run:

    .venv/bin/python results/criteria/run.py [--lengths 2048,4096] [--samples 10] [--tail | --bytes] [--tasks ...]
        [--families F,... [--families-at LENGTH,...]] [--length-families LENGTH:F,...] [--length-samples LENGTH:N]
        [--out DIR]

``--tail``: issue 23's comparison (the tail-aware family and the baselines it must beat, fewer points each).
``--bytes``: issue 32's (``--tail``'s plus window ∪ E and Quest; the comparison report ranks them over kv_read too).

Writes ``results/criteria/<task>-<length>/`` (rows, calibration artifacts), ``results.{json,csv,md}``, the
plot and the comparison report (``compare.md``: area under score-vs-sparsity over [0.7, 0.95], who dominates).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVAL_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
CALIBRATION_TASKS = ("niah_single_3", "niah_multikey_2", "vt")
EVAL_SEED, CALIBRATION_SEED = 7, 100
TAU_STATIC = 0.6
WINDOW = {"t_local": 128, "t_sink": 16}
SPARSITIES = (0.7, 0.8, 0.85, 0.9, 0.95)


def calibration_artifacts(model, tokenizer, length: int, samples: int, folder: Path,
                          correction: bool = True) -> dict[str, Path]:
    """Static local frequencies (and, when available, the QAdA correction) fitted on the calibration tasks."""
    from qada.eval.calibrate import calibrate_static, save_static_frequency
    from qada.eval.tasks import TASKS

    prompts = [s for task in CALIBRATION_TASKS
               for s in TASKS.build(task).generate(tokenizer, length, samples, CALIBRATION_SEED)]
    info = {"tasks": list(CALIBRATION_TASKS), "seed": CALIBRATION_SEED, "n": len(prompts), "length": length,
            "tau_static": TAU_STATIC}
    out = {"static": folder / f"static-{length}.safetensors"}
    if not out["static"].is_file():
        frequency = calibrate_static(model, tokenizer, prompts, TAU_STATIC, decode_with_oracle=True)
        save_static_frequency(out["static"], frequency, model, alpha=0.85, info=info)
    if not correction:
        return out
    from qada.eval.calibrate import collect_log_bulk_samples, save_qada_correction_fit
    from qada.functional import fit_log_correction

    fits = {"correction": None, "correction-q90": 0.9}  # least-squares offsets, and conservative 0.9-quantile ones
    for name in fits:
        out[name] = folder / f"{name}-{length}.safetensors"
    if not all(out[name].is_file() for name in fits):
        recorded = collect_log_bulk_samples(model, tokenizer, prompts, "stored", TAU_STATIC)
        for name, quantile in fits.items():
            fit = fit_log_correction(recorded.estimate, recorded.truth, recorded.log_t_bulk, 1.0, quantile)
            save_qada_correction_fit(out[name], fit, model, info={**info, "moments": "stored", "ridge": 1.0,
                                                                  "quantile": quantile})
    return out


TAIL_TAUS = (0.15, 0.2, 0.3, 0.4)
TAIL_BUDGETS = (0.85, 0.9, 0.95)


def tail_configs(model, artifacts: dict[str, Path]) -> list:
    """Issue 23's comparison: the tail-aware family against what it must beat (dense, the oracle, plain QAdA,
    ``qada_budget``, static from other tasks), with fewer points per baseline than :func:`configs`."""
    from qada.eval.calibrate import load_static_frequency
    from qada.eval.configs import EvalConfig
    from qada.functional import calibrate_static_mask

    def config(label, criterion, moments, family):
        return EvalConfig(label, criterion, moments, "sdpa", WINDOW, family)

    out = [config("dense", "dense", None, "dense")]
    out += [config(f"oracle tau={t}", {"name": "oracle", "tau": t}, None, "oracle") for t in (0.3, 0.6, 0.9)]
    out += [config(f"qada/stored tau={t}", {"name": "qada", "tau": t}, "stored", "qada/stored") for t in (0.4, 0.6)]
    frequency, _ = load_static_frequency(artifacts["static"], model)
    out += [config(f"static alpha={a}", {"name": "static", "mask": calibrate_static_mask(frequency, a).tolist()},
                   None, "static (other tasks)") for a in SPARSITIES]
    out += [config(f"qada_budget sparsity={s}", {"name": "qada_budget", "sparsity": s}, "stored", "qada_budget")
            for s in (0.7, 0.85, 0.9, 0.95)]
    out += [config(f"qada_tail tau={t}", {"name": "qada_tail", "tau": t}, "stored", "qada_tail") for t in TAIL_TAUS]
    out += [config(f"qada_tail_budget sparsity={s}", {"name": "qada_tail_budget", "sparsity": s}, "stored",
                   "qada_tail_budget") for s in TAIL_BUDGETS]
    return out


QUEST_PAGES = (4, 8, 16, 32)
#: The read-lean tail setting (docs: "Cheaper bounds"): a page hierarchy of 256-token super-pages, exact sets sized
#: for 8k and scaled by sqrt(C / 8k).
LEAN = {"super_page": 16, "super_pages": 4, "pages": 4, "heavy": 16, "scale_exact": 8192}
#: The same, with sizes that only grow (below 8k they stay the 8k ones): at 2k the shrunk sets lost needles.
LEAN_FLOOR = {**LEAN, "shrink_exact": False}


def bytes_configs(model, artifacts: dict[str, Path]) -> list:
    """Issue 32's comparison, on the kv_read axis: :func:`tail_configs` plus the tail family's local heads attending
    over window ∪ E (``attend_exact``), the read-lean setting (:data:`LEAN`), the budget rule allocated over the
    layers by the static calibration (other tasks), and the Quest baseline at several page counts."""
    from qada.eval.configs import EvalConfig

    def config(label, criterion, moments, family):
        return EvalConfig(label, criterion, moments, "sdpa", WINDOW, family)

    out = tail_configs(model, artifacts)
    out += [config(f"qada_tail+E tau={t}", {"name": "qada_tail", "tau": t, "attend_exact": True}, "stored",
                   "qada_tail+E") for t in TAIL_TAUS]
    out += [config(f"quest pages={k}", {"name": "quest", "pages": k}, None, "quest") for k in QUEST_PAGES]
    out += [config(f"qada_tail/lean tau={t}", {"name": "qada_tail", "tau": t, **LEAN}, "stored", "qada_tail/lean")
            for t in (0.2, 0.3)]
    out += [config(f"qada_tail+E/lean tau={t}", {"name": "qada_tail", "tau": t, "attend_exact": True, **LEAN},
                   "stored", "qada_tail+E/lean") for t in (0.15, 0.2, 0.3)]
    out += [config(f"qada_tail_budget+E/lean/alloc sparsity={s}",
                   {"name": "qada_tail_budget", "sparsity": s, "attend_exact": True, "allocation":
                    str(artifacts["static"]), **LEAN}, "stored", "qada_tail_budget+E/lean/alloc")
            for s in (0.85, 0.9)]
    # the budget rule per KV group (kv_sparsity = sparsity), evenly or halfway to the calibrated allocation
    for suffix, extra in (("group", {}), ("group/alloc.5", {"allocation": str(artifacts["static"]),
                                                            "allocation_weight": 0.5})):
        out += [config(f"qada_tail_budget+E/lean/{suffix} sparsity={s}",
                       {"name": "qada_tail_budget", "sparsity": s, "attend_exact": True, "per_group": True, **extra,
                        **LEAN}, "stored", f"qada_tail_budget+E/lean/{suffix}") for s in (0.85, 0.9)]
    out += [config(f"qada_tail+E/lean-floor tau={t}", {"name": "qada_tail", "tau": t, "attend_exact": True,
                                                       **LEAN_FLOOR}, "stored", "qada_tail+E/lean-floor")
            for t in (0.15, 0.2, 0.3)]
    out += [config(f"qada_tail_budget+E/lean-floor/group sparsity={s}",
                   {"name": "qada_tail_budget", "sparsity": s, "attend_exact": True, "per_group": True,
                    **LEAN_FLOOR}, "stored", "qada_tail_budget+E/lean-floor/group") for s in (0.85, 0.9)]
    # "promote": a local head whose KV group reads its bulk anyway attends to all of it (no extra bytes)
    out += [EvalConfig(f"qada_tail+E/lean/promote tau={t}", {"name": "qada_tail", "tau": t, "attend_exact": True,
                                                             **LEAN},
                       "stored", {"name": "sdpa", "group_policy": "promote"}, WINDOW, "qada_tail+E/lean/promote")
            for t in (0.15, 0.2, 0.3)]
    return out


def configs(model, artifacts: dict[str, Path], new_families: bool = True) -> list:
    """Every configuration of a cell: the paper's families plus budgeted, calibrated and hybrid QAdA."""
    from qada.criteria import CRITERIA
    from qada.eval.calibrate import load_static_frequency
    from qada.eval.configs import EvalConfig
    from qada.functional import calibrate_static_mask

    def config(label, criterion, moments, family):
        return EvalConfig(label, criterion, moments, "sdpa", WINDOW, family)

    out = [config("dense", "dense", None, "dense")]
    out += [config(f"oracle tau={t}", {"name": "oracle", "tau": t}, None, "oracle") for t in (0.3, 0.6, 0.9)]
    out += [config(f"qada/stored tau={t}", {"name": "qada", "tau": t}, "stored", "qada/stored")
            for t in (0.4, 0.6, 0.8, 0.9)]
    out += [config(f"qada/current tau={t}", {"name": "qada", "tau": t}, "current", "qada/current") for t in (0.6, 0.9)]
    frequency, _ = load_static_frequency(artifacts["static"], model)
    out += [config(f"static alpha={a}", {"name": "static", "mask": calibrate_static_mask(frequency, a).tolist()},
                   None, "static (other tasks)") for a in SPARSITIES]
    if not new_families:
        return out
    if "qada_budget" in CRITERIA:
        # 0.96: a 9-head model's budgets average 0.948 at 0.95, so this point makes the curve span [0.7, 0.95]
        out += [config(f"qada_budget sparsity={s}", {"name": "qada_budget", "sparsity": s}, "stored", "qada_budget")
                for s in (*SPARSITIES, 0.96)]
        out += [config(f"qada_budget/group sparsity={s}", {"name": "qada_budget", "sparsity": s, "per_group": True},
                       "stored", "qada_budget/group") for s in (0.8, 0.9)]
    if "qada_calibrated" in CRITERIA and "correction" in artifacts:
        out += [config(f"qada_calibrated tau={t}", {"name": "qada_calibrated", "tau": t,
                                                    "correction": str(artifacts["correction"])},
                       "stored", "qada_calibrated") for t in (0.6, 0.9)]
        out += [config(f"qada_calibrated/q90 tau={t}", {"name": "qada_calibrated", "tau": t,
                                                        "correction": str(artifacts["correction-q90"])},
                       "stored", "qada_calibrated/q90") for t in (0.3, 0.6)]
    if "qada_tail" in CRITERIA:  # issue 23: eq. 7 with the heavy tail scored exactly (heavy set + top pages)
        out += [config(f"qada_tail tau={t}", {"name": "qada_tail", "tau": t}, "stored", "qada_tail")
                for t in TAIL_TAUS]
        out += [config(f"qada_tail_budget sparsity={s}", {"name": "qada_tail_budget", "sparsity": s}, "stored",
                       "qada_tail_budget") for s in TAIL_BUDGETS]
    if "hybrid" in CRITERIA:
        for fraction in (0.1,):
            for s in (0.85, 0.9, 0.95):
                out.append(config(f"hybrid dense={fraction} budget={s}",
                                  {"name": "hybrid", "calibration": str(artifacts["static"]),
                                   "dense_fraction": fraction, "base": {"name": "qada_budget", "sparsity": s}},
                                  "stored", f"hybrid dense={fraction}"))
    return out


def read_goal(length: int) -> float:
    """Issue 32's goal for the single-needle tasks: the kv_read at or under which 95% of the dense score must hold
    (.40 at 2k, .25 at 4k, .15 at 8k; SmolLM2's 8k cells are 8000 tokens, its positions end at 8192)."""
    return 0.40 if length < 3000 else 0.25 if length < 6000 else 0.15


def goals_markdown(records: list[dict], command: str) -> str:
    """Per cell and family, the cheapest measured point (lowest kv_read) that keeps 95% of the dense score (single
    needle) or stays within 5 points of it (multikey), next to the goal; read off the measured rows, nothing
    interpolated."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        cells.setdefault((record["task"], record["length"]), []).append(record)
    lines = ["# Fidelity per byte: the cheapest point that keeps the dense score", "",
             f"Produced by `{command}`. Per cell and family: the lowest kv_read among its measured points whose score "
             "is >= 95% of dense (niah_single_*) or within 5 points of dense (niah_multikey_1), and that point's "
             "score; `-` where no point does. Goals: kv_read <= .40 (2k), .25 (4k), .15 (8k) for the single-needle "
             "tasks, <= .5 for multikey.", ""]
    for (task, length), rows in sorted(cells.items()):
        dense = next((r for r in rows if r["family"] == "dense"), None)
        if dense is None:
            continue
        multikey = task.startswith("niah_multikey")
        floor = dense["score"] - 5 if multikey else 0.95 * dense["score"]
        goal = 0.5 if multikey else read_goal(length)
        lines += [f"## {task} at {length} (n = {dense['n']}, dense {dense['score']:.1f}; goal kv_read <= {goal})", "",
                  "| family | cheapest kv_read keeping it | its score | configuration | meets the goal |",
                  "|---|---|---|---|---|"]
        best = {}
        for row in rows:
            if row["family"] == "dense" or row.get("kv_read") is None or row["score"] < floor:
                continue
            if row["family"] not in best or row["kv_read"] < best[row["family"]]["kv_read"]:
                best[row["family"]] = row
        for family in sorted({r["family"] for r in rows} - {"dense"}):
            row = best.get(family)
            if row is None:
                lines.append(f"| {family} | - | - | - | no |")
            else:
                met = "yes" if row["kv_read"] <= goal else "no"
                lines.append(f"| {family} | {row['kv_read']:.3f} | {row['score']:.1f} | {row['label']} | {met} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--calibration-samples", type=int, default=3, help="per calibration task")
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--artifacts", default=str(HERE), help="folder of the calibration artifacts (made if missing)")
    parser.add_argument("--baseline-only", action="store_true",
                        help="only dense, oracle, QAdA and static (the families of the paper)")
    parser.add_argument("--tail", action="store_true",
                        help="issue 23's comparison only: the tail-aware family and the baselines it must beat")
    parser.add_argument("--bytes", action="store_true",
                        help="issue 32's comparison: --tail's configurations plus window ∪ E and Quest (read the "
                             "results on the kv_read axis)")
    parser.add_argument("--tasks", default=",".join(EVAL_TASKS))
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (at most the cores; two runs side by side: 1 each)")
    parser.add_argument("--families", default=None,
                        help="comma-separated families to run (default: all of the chosen comparison's)")
    parser.add_argument("--families-at", default=None,
                        help="comma-separated lengths at which --families applies (default: every length); the "
                             "other lengths run every family, so one command reports them all")
    parser.add_argument("--length-samples", action="append", default=[], metavar="LENGTH:N",
                        help="prompts per task at one length (repeatable; overrides --samples there)")
    parser.add_argument("--length-families", action="append", default=[], metavar="LENGTH:F,...",
                        help="the families to run at one length (repeatable; overrides --families there)")
    args = parser.parse_args(argv)
    if sum((args.tail, args.baseline_only, args.bytes)) > 1:
        parser.error("--tail, --bytes and --baseline-only exclude each other")
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(tasks) - set(EVAL_TASKS))
    if unknown:
        parser.error(f"unknown task(s) {unknown}; expected some of {list(EVAL_TASKS)}")

    families = set(args.families.split(",")) if args.families else None
    restricted = {int(x) for x in args.families_at.split(",")} if args.families_at else None
    samples_at = {}
    for item in args.length_samples:
        length_text, _, count = item.partition(":")
        if not (length_text.isdigit() and count.isdigit() and int(count) > 0):
            parser.error(f"expected --length-samples LENGTH:N but got {item!r}")
        samples_at[int(length_text)] = int(count)
    per_length = {}
    for item in args.length_families:
        length_text, _, names = item.partition(":")
        if not length_text.isdigit() or not names:
            parser.error(f"expected --length-families LENGTH:F1,F2,... but got {item!r}")
        per_length[int(length_text)] = set(names.split(","))

    import torch

    torch.set_num_threads(max(1, min(args.threads, os.cpu_count() or 1)))
    from qada.eval.evaluator import Evaluator
    from qada.eval.report import format_table, plot_score_vs_sparsity, result_record, write_results
    from qada.eval.sweep import _provenance, artifact_provenance
    from qada.eval.tasks import TASKS
    from qada.models import load_model

    start = time.time()
    model, tokenizer = load_model(None)
    out = Path(args.out)
    records = []
    for length in (int(x) for x in args.lengths.split(",")):
        artifacts = calibration_artifacts(model, tokenizer, length, args.calibration_samples, Path(args.artifacts),
                                          not (args.baseline_only or args.tail or args.bytes))
        cell_configs = (tail_configs(model, artifacts) if args.tail else bytes_configs(model, artifacts)
                        if args.bytes else configs(model, artifacts, not args.baseline_only))
        chosen = per_length.get(length, families if restricted is None or length in restricted else None)
        if chosen:
            unknown_families = sorted(chosen - {c.family for c in cell_configs})
            if unknown_families:
                parser.error(f"unknown families {unknown_families}; expected some of "
                             f"{sorted({c.family for c in cell_configs})}")
            cell_configs = [c for c in cell_configs if c.family in chosen]
        static = _provenance(artifacts["static"], drop=("alpha",))
        fitted_on = {c.label: [static] if c.family.startswith("static") else artifact_provenance(c.criterion)
                     for c in cell_configs}
        for task in tasks:
            samples = TASKS.build(task).generate(tokenizer, length, samples_at.get(length, args.samples), EVAL_SEED)
            settings = {"seed": EVAL_SEED, "template": "base", "data": {"task": task, "length": length}}
            evaluator = Evaluator(model, tokenizer, cell_configs, out / f"{task}-{length}", settings=settings)
            results = evaluator.evaluate(samples)
            records += [result_record(entry, task, length, len(samples), model, EVAL_SEED,
                                      {"fitted_on": fitted_on[entry["label"]]} if fitted_on[entry["label"]] else {})
                        for entry in results.values()]
    print(format_table(records))
    command = "python results/criteria/run.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    write_results(records, out, command=command.strip())
    plot_score_vs_sparsity(records, out / "score_vs_sparsity.png", "criteria on unseen prompts (SmolLM2-135M)")
    try:
        from qada.eval.compare import write_comparison
    except ImportError:
        pass
    else:
        write_comparison(records, out, command=command.strip())
    (out / "goals.md").write_text(goals_markdown(records, command.strip()))
    print(f"done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
