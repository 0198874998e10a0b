"""``qada sweep``: a grid of configurations over tasks and lengths; a results folder with tables and plots."""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS, HelpFormatter, positive_int

#: The static-mask families ``--static`` takes (see :func:`qada.eval.sweep.run_sweep`).
STATIC_FAMILIES = ("static_oracle", "static_ruler")


def float_list(text: str) -> list[float]:
    """An ``argparse`` type: ``"0.3,0.6"`` -> ``[0.3, 0.6]``."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers but got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number but got {text!r}")
    return values


def static_families(text: str) -> tuple[str, ...]:
    """An ``argparse`` type: ``"static_oracle,static_ruler"`` -> the families; ``""`` -> none; others are errors."""
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in STATIC_FAMILIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown static famil{'y' if len(unknown) == 1 else 'ies'} "
                                         f"{', '.join(map(repr, unknown))}; expected some of "
                                         f"{', '.join(STATIC_FAMILIES)} (comma-separated, '' for none)")
    return names


def split_moment_sources(text: str) -> tuple[str, ...]:
    """``"a,b"`` or ``"a;b:k=v,k2=v2"`` -> the moment-source specs (``;`` separates when parameters use commas)."""
    parts = text.split(";") if ";" in text or ":" in text else text.split(",")
    return tuple(p.strip() for p in parts if p.strip())


def make_fabric(accelerator: str, devices: int):
    """A launched Lightning Fabric: one process, or ``devices`` DDP processes (this command is re-run per rank)."""
    from lightning.fabric import Fabric

    if devices < 1:
        raise ValueError(f"expected --devices >= 1 but got {devices}")
    fabric = Fabric(accelerator=accelerator, devices=devices, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    return fabric


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sweep", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="sweep criteria x thresholds over tasks and lengths; results + plots",
    )
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2", help="comma-separated task names")
    parser.add_argument("--lengths", default="2048", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--samples", type=positive_int, default=10, help="samples per task and length")
    parser.add_argument("--taus", type=float_list, default=None,
                        help="comma-separated taus for oracle and QAdA (default: the paper's grid, 0.1..0.995)")
    parser.add_argument("--alphas", type=float_list, default=None,
                        help="comma-separated alphas for the static masks (default: 0.05..0.95 in steps of 0.05)")
    parser.add_argument("--moments", default="stored,current",
                        help="QAdA moment sources, one curve each, comma-separated; with parameters, separated by ';', "
                             "e.g. 'current;stored:prompt=single_word;stored:prompt=text,offset=2048'")
    parser.add_argument("--static", type=static_families, default=",".join(STATIC_FAMILIES),
                        help=f"static families, comma-separated: some of {', '.join(STATIC_FAMILIES)}; '' for none")
    parser.add_argument("--calibration-samples", type=positive_int, default=None,
                        help="samples per other task for static_ruler calibration (default: --samples)")
    parser.add_argument("--record-oracle", action="store_true", help="also measure agreement with the oracle")
    parser.add_argument("--template", default="base", choices=["base", "chat"], help="prompt template")
    parser.add_argument("--model", default=None, help="model directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument("--out", required=True, help="results folder; a rerun reuses its finished results")
    parser.add_argument("--devices", type=positive_int, default=1,
                        help="processes (Lightning Fabric DDP: gloo on CPU, NCCL on GPUs); samples are sharded")
    parser.add_argument("--accelerator", default="cpu", help="cpu, gpu/cuda or auto")
    parser.add_argument("--report-only", action="store_true",
                        help="no decoding: tables and plot from the finished per-sample results in --out")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qada.eval.report import format_table, plot_score_vs_sparsity, write_results
    from qada.eval.sweep import run_sweep
    from qada.models import load_model

    if args.report_only:
        from qada.eval.report import records_from_rows

        records = records_from_rows(args.out)
        if not records:
            raise FileNotFoundError(f"no results-rank*.jsonl under {args.out}")
        print(format_table(records))
        json_path, csv_path = write_results(records, args.out)
        plot = plot_score_vs_sparsity(records, Path(args.out) / "score_vs_sparsity.png")
        print(f"wrote {json_path}, {csv_path}, {plot}")
        return 0
    from qada.eval.tasks import TASKS
    from qada.eval.validate import check_count, check_output_dir

    # checked before the model loads (run_sweep checks again, with the model: lengths vs. its positions)
    check_count(args.samples, "--samples")
    check_output_dir(args.out, "--out")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for task in tasks:
        TASKS.get(task)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected --lengths to be comma-separated integers but got {args.lengths!r}") from None
    if not tasks or not lengths:
        raise ValueError(f"expected at least one task and one length but got --tasks {args.tasks!r} "
                         f"--lengths {args.lengths!r}")
    from qada.eval.configs import sweep_configs

    for config in sweep_configs(args.taus or [0.5], split_moment_sources(args.moments)):
        config.build()  # bad taus or moment-source parameters fail here
    fabric = make_fabric(args.accelerator, args.devices)
    model, tokenizer = load_model(args.model, device=fabric.device)
    records = run_sweep(
        model, tokenizer, tasks, lengths, args.samples, args.out, taus=args.taus, alphas=args.alphas,
        moment_sources=split_moment_sources(args.moments),
        static=args.static, calibration_samples=args.calibration_samples,
        record_oracle=args.record_oracle, seed=args.seed,
        template=args.template, fabric=fabric, progress=fabric.global_rank == 0,
    )
    if fabric.global_rank != 0:
        return 0
    print(format_table(records))
    json_path, csv_path = write_results(records, args.out)
    plot = plot_score_vs_sparsity(records, Path(args.out) / "score_vs_sparsity.png")
    print(f"wrote {json_path}, {csv_path}, {plot}")
    return 0
