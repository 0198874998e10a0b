"""Issue 17's long-context run: Gemma-3-270M (32k positions, hybrid attention) on RULER at 8k, 16k and 32k.

Dense vs oracle vs QAdA (stored-reference moments, the reference built once at 32k) vs a static head set and
budgeted QAdA, on niah_single_1, niah_single_2 and niah_multikey_1. qada decides on the three global layers
(5, 11, 17); the fifteen sliding-window layers (512 tokens) pass through. The static head set is calibrated on
*other* tasks (niah_single_3, niah_multikey_2, vt) at 4096 tokens with another seed, so no evaluated prompt
or task was seen by it.

Each length runs in its own process, so its peak memory (``ru_maxrss``) and wall time are its own; they are
written to ``resources-<length>.json`` (collected in ``resources.json``) with every prefill's time; a length
whose resources file exists is finished and not rerun (delete the file to rerun it). Per-sample rows resume
(identity-checked), so the command can be rerun to finish an interrupted run:

    .venv/bin/python results/long_context/run.py [--lengths 8192,16384,32736] [--samples 8192:3,16384:2,32736:1]

"32k" is 32736 prompt tokens: qada's RULER generators size the prompt alone to the length, and prompt plus answer
must fit the model's 32768 positions (a prompt of 32768 is refused before any work).

Writes ``results/long_context/<task>-<length>/`` (rows), ``static-4096.safetensors``, ``results.{json,csv,md}``,
``resources.json`` and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "gemma3-270m"
EVAL_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
CALIBRATION_TASKS = ("niah_single_3", "niah_multikey_2", "vt")
EVAL_SEED, CALIBRATION_SEED = 7, 100
TAU_STATIC = 0.6
WINDOW = {"t_local": 128, "t_sink": 16}
TAUS_ORACLE = (0.3, 0.6, 0.9)
TAUS_QADA = (0.4, 0.6, 0.8, 0.9)
ALPHAS = (0.5, 0.75, 0.9)
BUDGETS = (0.75, 0.9)


def static_artifact(model, tokenizer, length: int, samples: int, folder: Path) -> Path:
    """Static local frequencies fitted on the calibration tasks at ``length`` (made once)."""
    from qada.eval.calibrate import calibrate_static, save_static_frequency
    from qada.eval.tasks import TASKS

    path = folder / f"static-{length}.safetensors"
    if path.is_file():
        return path
    prompts = [s for task in CALIBRATION_TASKS
               for s in TASKS.build(task).generate(tokenizer, length, samples, CALIBRATION_SEED)]
    info = {"tasks": list(CALIBRATION_TASKS), "seed": CALIBRATION_SEED, "n": len(prompts), "length": length,
            "tau_static": TAU_STATIC}
    frequency = calibrate_static(model, tokenizer, prompts, TAU_STATIC, decode_with_oracle=True)
    save_static_frequency(path, frequency, model, alpha=0.75, info=info)
    return path


def configs(model, static_path: Path) -> list:
    """Dense, oracle, QAdA (stored), static (other tasks) and budgeted QAdA."""
    from qada.eval.calibrate import load_static_frequency
    from qada.eval.configs import EvalConfig
    from qada.functional import calibrate_static_mask

    def config(label, criterion, moments, family):
        return EvalConfig(label, criterion, moments, "sdpa", WINDOW, family)

    frequency, _ = load_static_frequency(static_path, model)
    return [
        config("dense", "dense", None, "dense"),
        *[config(f"oracle tau={t}", {"name": "oracle", "tau": t}, None, "oracle") for t in TAUS_ORACLE],
        *[config(f"qada/stored tau={t}", {"name": "qada", "tau": t}, "stored", "qada/stored") for t in TAUS_QADA],
        *[config(f"static alpha={a}", {"name": "static", "mask": calibrate_static_mask(frequency, a).tolist()},
                 None, "static (other tasks)") for a in ALPHAS],
        *[config(f"qada_budget sparsity={s}", {"name": "qada_budget", "sparsity": s}, "stored", "qada_budget")
          for s in BUDGETS],
    ]


def run_length(length: int, samples: int, args) -> None:
    """One length, in this process: evaluate every task and write its resource use to ``resources-<length>.json``."""
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from qada.eval.evaluator import Evaluator
    from qada.eval.tasks import TASKS
    from qada.models import load_model

    start = time.time()
    out = Path(args.out)
    model, tokenizer = load_model(MODEL)
    static_path = static_artifact(model, tokenizer, args.calibration_length, args.calibration_samples, out)
    cell_configs = configs(model, static_path)
    prefills = {}
    for task in EVAL_TASKS:
        task_samples = TASKS.build(task).generate(tokenizer, length, samples, EVAL_SEED)
        settings = {"seed": EVAL_SEED, "template": "base", "data": {"task": task, "length": length}}
        evaluator = Evaluator(model, tokenizer, cell_configs, out / f"{task}-{length}", settings=settings)
        evaluator.evaluate(task_samples)
        rows = [json.loads(line) for line in evaluator.results_path.read_text().splitlines() if line.strip()]
        prefills[task] = sorted({round(r["prefill_seconds"], 1) for r in rows if "prefill_seconds" in r})
    record = {
        "length": length, "samples": samples, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "seconds": time.time() - start, "prefill_seconds": prefills, "load_average_1min_end": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
        "note": "peak_rss_gb is this process's peak (model, stored reference, prefill, decoding); seconds include "
                "work resumed from earlier runs only as far as it was redone",
    }
    (out / f"resources-{length}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record), flush=True)


def report(lengths: list[int], samples: dict[int, int], args) -> None:
    """Tables and plot from the finished rows of every length (no decoding: every row resumes)."""
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from qada.eval.evaluator import Evaluator
    from qada.eval.report import format_table, plot_score_vs_sparsity, result_record, write_results
    from qada.eval.sweep import _provenance
    from qada.eval.tasks import TASKS
    from qada.models import load_model

    out = Path(args.out)
    model, tokenizer = load_model(MODEL)
    static_path = out / f"static-{args.calibration_length}.safetensors"
    cell_configs = configs(model, static_path)
    static = _provenance(static_path, drop=("alpha",))
    records = []
    for length in lengths:
        for task in EVAL_TASKS:
            task_samples = TASKS.build(task).generate(tokenizer, length, samples[length], EVAL_SEED)
            settings = {"seed": EVAL_SEED, "template": "base", "data": {"task": task, "length": length}}
            evaluator = Evaluator(model, tokenizer, cell_configs, out / f"{task}-{length}", settings=settings,
                                  progress=False)
            results = evaluator.evaluate(task_samples)
            records += [result_record(entry, task, length, len(task_samples), model, EVAL_SEED,
                                      {"fitted_on": [static]} if entry["family"].startswith("static") else {})
                        for entry in results.values()]
    print(format_table(records))
    command = "python results/long_context/run.py " + " ".join(sys.argv[1:])
    write_results(records, out, command=command.strip())
    plot_score_vs_sparsity(records, out / "score_vs_sparsity.png",
                           "Gemma-3-270M, RULER 8k-32k (sparsity over the 3 global layers)")
    resources = [json.loads((out / f"resources-{n}.json").read_text()) for n in lengths
                 if (out / f"resources-{n}.json").is_file()]
    (out / "resources.json").write_text(json.dumps(resources, indent=2) + "\n")
    (out / "summary.md").write_text(
        "Score (global-layer sparsity / kv_sparsity) per configuration; sparsity over all 18 layers is "
        "(3 x sparsity + 15) / 18 (`sparsity_all_layers` in results.json).\n\n"
        f"Command: `{command.strip()}`\n\n" + compact_table(records, resources))


def compact_table(records: list[dict], resources: list[dict]) -> str:
    """Markdown: score (global-layer sparsity / kv_sparsity) of each configuration per (task, length), and the
    resources of each length."""
    cells = sorted({(r["length"], r["task"]) for r in records})
    labels = list(dict.fromkeys(r["label"] for r in records))
    by = {(r["length"], r["task"], r["label"]): r for r in records}

    def cell(r):
        if r is None:
            return ""
        sparsity = "–" if r["sparsity"] is None else f"{r['sparsity']:.2f}"
        kv = "–" if r["kv_sparsity"] is None else f"{r['kv_sparsity']:.2f}"
        return f"{r['score']:.0f} ({sparsity} / {kv})"

    lines = ["| configuration | " + " | ".join(f"{task} {length} (n={by[length, task, labels[0]]['n']})"
                                             for length, task in cells) + " |",
             "|---|" + "---|" * len(cells)]
    lines += [f"| {label} | " + " | ".join(cell(by.get((length, task, label))) for length, task in cells) + " |"
              for label in labels]
    lines += ["", "| prompt tokens | samples per task | prefill s (each prompt) | peak memory GB | wall time s |",
              "|---|---|---|---|---|"]
    for res in resources:
        prefills = sorted(x for values in res["prefill_seconds"].values() for x in values)
        lines.append(f"| {res['length']} | {res['samples']} | {prefills[0]:.0f}-{prefills[-1]:.0f} | "
                     f"{res['peak_rss_gb']:.1f} | {res['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,16384,32736")
    parser.add_argument("--samples", default="8192:3,16384:2,32736:1",
                        help="samples per task at each length, LENGTH:N comma-separated")
    parser.add_argument("--calibration-length", type=int, default=4096)
    parser.add_argument("--calibration-samples", type=int, default=2, help="per calibration task")
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--one-length", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    samples = {int(k): int(v) for k, v in (item.split(":") for item in args.samples.split(","))}
    lengths = [int(x) for x in args.lengths.split(",")]
    missing = [n for n in lengths if n not in samples]
    if missing:
        parser.error(f"--samples gives no count for length(s) {missing}")
    if args.one_length is not None:
        run_length(args.one_length, samples[args.one_length], args)
        return 0
    start = time.time()
    for length in lengths:  # one process per length: its own peak memory
        if (Path(args.out) / f"resources-{length}.json").is_file():  # finished: keep its measured resources
            continue
        command = [sys.executable, __file__, "--one-length", str(length), "--lengths", args.lengths,
                   "--samples", args.samples,
                   "--calibration-length", str(args.calibration_length),
                   "--calibration-samples", str(args.calibration_samples), "--out", args.out]
        subprocess.run(command, check=True)
    report(lengths, samples, args)
    print(f"done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
