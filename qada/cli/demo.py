"""``qada demo``: the main job, a small real sweep on the embedded model.

niah_single_1 and niah_single_2 at 2k tokens, a few samples each: dense, static (oracle- and RULER-calibrated),
oracle and QAdA (stored random-words and current-prompt moments) at a few thresholds. Prints a table of score
and sparsity and writes results (JSON, CSV) and the score-vs-sparsity plot.
"""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo", parents=[IMPORTS], help="a small real sweep on the embedded model: table + plot (~3 min on 2 cores)"
    )
    parser.add_argument("--out", default="qada-demo", help="results folder (default ./qada-demo)")
    parser.add_argument("--samples", type=int, default=3, help="samples per task (default 3)")
    parser.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default 2048)")
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke test (1 sample, 1k tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from qada.eval.report import format_table, plot_score_vs_sparsity, write_results
    from qada.eval.sweep import run_sweep
    from qada.models import load_model

    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    if args.quick:
        tasks, length, samples = ["niah_single_1", "niah_single_2"], 1024, 1
        taus, alphas, sources = [0.6], [0.5], ("current",)
    else:
        tasks, length, samples = ["niah_single_1", "niah_single_2"], args.length, args.samples
        taus, alphas, sources = [0.6, 0.9], [0.5, 0.8], ("stored", "current")
    records = run_sweep(model, tokenizer, tasks, [length], samples, args.out, taus=taus, alphas=alphas,
                        moment_sources=sources, seed=args.seed)
    print(format_table(records))
    json_path, csv_path = write_results(records, args.out)
    plot = plot_score_vs_sparsity(records, Path(args.out) / "score_vs_sparsity.png", "qada demo (embedded SmolLM2)")
    print(f"\nwrote {json_path}, {csv_path}, {plot} in {time.perf_counter() - start:.0f} s")
    return 0
