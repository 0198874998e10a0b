"""``qada sweep``: a grid of configurations over tasks and lengths; a results folder with tables and plots."""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


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
        "sweep", parents=[IMPORTS], help="sweep criteria x thresholds over tasks and lengths; results + plots"
    )
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2", help="comma-separated task names")
    parser.add_argument("--lengths", default="2048", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--taus", type=_floats, default=None, help="comma-separated taus (default: the paper's grid)")
    parser.add_argument("--alphas", type=_floats, default=None, help="comma-separated alphas (default 0.05..0.95)")
    parser.add_argument("--moments", default="stored,current",
                        help="QAdA moment sources, one curve each: 'stored,current', or with parameters separated "
                             "by ';' (e.g. 'current;stored:prompt=single_word;stored:prompt=text,offset=2048')")
    parser.add_argument("--static", default="static_oracle,static_ruler", help="static families ('' for none)")
    parser.add_argument("--calibration-samples", type=int, default=None,
                        help="samples per other task for static_ruler calibration (default: --samples)")
    parser.add_argument("--record-oracle", action="store_true", help="also measure agreement with the oracle")
    parser.add_argument("--template", default="base", choices=["base", "chat"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="results folder (resumable)")
    parser.add_argument("--devices", type=int, default=1,
                        help="processes (Lightning Fabric DDP: gloo on CPU, NCCL on GPUs); samples are sharded")
    parser.add_argument("--accelerator", default="cpu", help="cpu, gpu/cuda or auto (default cpu)")
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
    fabric = make_fabric(args.accelerator, args.devices)
    model, tokenizer = load_model(args.model, device=fabric.device)
    tasks = [t for t in args.tasks.split(",") if t]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    records = run_sweep(
        model, tokenizer, tasks, lengths, args.samples, args.out, taus=args.taus, alphas=args.alphas,
        moment_sources=split_moment_sources(args.moments),
        static=tuple(s for s in args.static.split(",") if s), calibration_samples=args.calibration_samples,
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
