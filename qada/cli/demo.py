"""``qada demo``: the main job, a small real sweep on the embedded model.

niah_single_1 and niah_single_2 at 2k tokens, a few samples each: dense, static (oracle- and RULER-calibrated),
oracle, QAdA (stored random-words and current-prompt moments) at a few thresholds and the tail-aware ``qada_tail``.
Prints a table of score, sparsity and kv_read (what a step reads, the criterion's own reads included) and the
decoding rate (observers timed apart), and writes results (JSON, CSV) and the score-vs-sparsity plot.
"""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS, HelpFormatter, add_model_arguments, model_placement, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="a small real sweep on the embedded model: table + plot (~3 min on 2 cores)",
    )
    parser.add_argument("--out", default="qada-demo", help="results folder; a rerun reuses its finished results")
    parser.add_argument("--samples", type=positive_int, default=3, help="samples per task")
    parser.add_argument("--length", type=positive_int, default=2048, help="prompt length in tokens")
    add_model_arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings for a smoke test: 1 sample, 1024 tokens, one tau and alpha")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os
    import time
    from pathlib import Path

    from qada.cli.common import build_eval_config
    from qada.eval.evaluator import ANSWER_MARGIN
    from qada.eval.report import format_table, plot_score_vs_sparsity, write_results
    from qada.eval.sweep import run_sweep
    from qada.eval.validate import check_output_dir
    from qada.models import load_model
    from qada.models.step_compile import COMPILE_ENV

    # Short answers (a few tokens per configuration and prompt): compiling each configuration's layer step would cost
    # more than it saves, so the demo decodes eagerly unless QADA_COMPILE says otherwise.
    os.environ.setdefault(COMPILE_ENV, "0")
    device, dtype = model_placement(args)  # before the model loads, as the output folder below
    check_output_dir(args.out, "--out")
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    if args.quick:
        tasks, length, samples = ["niah_single_1", "niah_single_2"], 1024, 1
        taus, alphas, sources = [0.6], [0.5], ("current",)
    else:
        tasks, length, samples = ["niah_single_1", "niah_single_2"], args.length, args.samples
        taus, alphas, sources = [0.6, 0.9], [0.5, 0.8], ("stored", "current")
    tail = build_eval_config({"name": "qada_tail", "tau": 0.3}, moments=sources[0])
    records = run_sweep(model, tokenizer, tasks, [length], samples, args.out, taus=taus, alphas=alphas,
                        moment_sources=sources, record_oracle=True, seed=args.seed, criteria=[tail])
    print(format_table(records))
    configs = len({r["label"] for r in records})
    print(f"\n{samples} sample{'s' * (samples != 1)} x {len(tasks)} tasks at {length} tokens x {configs} "
          f"configurations; greedy decoding stops at EOS or after the answer budget (the reference answer's tokens "
          f"+ {ANSWER_MARGIN}).\nkv_read: the K/V a decode step reads over dense attention's, what the criterion "
          "reads to decide included (qada_tail's page bounds and exact set).\nagree: the fraction of head decisions "
          "equal to the oracle's at the same tau (0.6 for static masks).\ndec tok/s: decode steps per second, the "
          "oracle agreement's exact masses left out (the rows decode eagerly: short answers).")
    json_path, csv_path = write_results(records, args.out)
    plot = plot_score_vs_sparsity(records, Path(args.out) / "score_vs_sparsity.png", "qada demo (embedded SmolLM2)")
    print(f"wrote {json_path}, {csv_path}, {plot} in {time.perf_counter() - start:.0f} s")
    return 0
