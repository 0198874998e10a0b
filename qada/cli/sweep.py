"""``qada sweep``: a grid of configurations over tasks and lengths; a results folder with tables and plots."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from qada.cli.common import IMPORTS, HelpFormatter, add_model_arguments, existing_file, model_placement, positive_int

if TYPE_CHECKING:
    import torch

#: The static-mask families ``--static`` takes (see :func:`qada.eval.sweep.run_sweep`).
STATIC_FAMILIES = ("static_oracle", "static_ruler")

#: ``--tasks`` and ``--lengths`` without ``--data``.
DEFAULT_TASKS, DEFAULT_LENGTHS = "niah_single_1,niah_single_2", "2048"


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


def fabric_devices(device: torch.device, devices: int) -> tuple[str, int | list[int]]:
    """``(accelerator, devices)`` of a Lightning Fabric on ``device`` (``--device``) with ``devices`` processes.

    On CUDA: one process per GPU; ``cuda:N`` runs one process on that GPU. A ``ValueError`` (a usage error) for
    what cannot run, before any work: ``cuda:N`` with ``--devices`` > 1, more processes than GPUs.
    """
    if devices < 1:
        raise ValueError(f"expected --devices >= 1 but got {devices}")
    if device.type != "cuda":
        return device.type, devices
    import torch

    if device.index is not None:
        if devices > 1:
            raise ValueError(f"--device {device} names one GPU but --devices is {devices}; give --device cuda to "
                             f"run on {devices} GPUs")
        return "cuda", [device.index]
    if devices > torch.cuda.device_count():
        raise ValueError(f"expected --devices <= the {torch.cuda.device_count()} GPU(s) here but got {devices}")
    return "cuda", devices


def make_fabric(device: torch.device, devices: int):
    """A launched Lightning Fabric on ``device``'s kind: one process, or ``devices`` DDP processes (this command
    is re-run per rank); see :func:`fabric_devices`."""
    from lightning.fabric import Fabric

    accelerator, chosen = fabric_devices(device, devices)
    fabric = Fabric(accelerator=accelerator, devices=chosen, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    return fabric


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sweep", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="sweep criteria x thresholds over tasks and lengths; results + plots",
    )
    parser.add_argument("--tasks", default=None,
                        help="comma-separated task names, generated at every --lengths (default: "
                             f"{DEFAULT_TASKS}; none with --data unless --lengths is given)")
    parser.add_argument("--lengths", default=None,
                        help=f"comma-separated prompt lengths in tokens (default: {DEFAULT_LENGTHS}; none with --data "
                             "unless --tasks is given)")
    parser.add_argument("--data", action="append", type=existing_file, default=None, metavar="FILE",
                        help="a RULER-format jsonl, one more (task, length) cell (task: the rows' task field, else "
                             "the folder's name; length: the mean prompt tokens; results in OUT/<file stem>/); "
                             "repeatable, combines with --tasks/--lengths (default: none)")
    parser.add_argument("--samples", type=positive_int, default=10,
                        help="samples per task and length (the first ones of each --data file)")
    parser.add_argument("--taus", type=float_list, default=None,
                        help="comma-separated taus for oracle and QAdA (default: the paper's grid, 0.1..0.995)")
    parser.add_argument("--alphas", type=float_list, default=None,
                        help="comma-separated alphas for the static masks (default: 0.05..0.95 in steps of 0.05)")
    parser.add_argument("--moments", default="stored,current",
                        help="QAdA moment sources, one curve each, comma-separated; with parameters, separated by ';', "
                             "e.g. 'current;stored:prompt=single_word;stored:prompt=text,offset=2048'")
    parser.add_argument("--static", type=static_families, default=",".join(STATIC_FAMILIES),
                        help=f"static families, comma-separated: some of {', '.join(STATIC_FAMILIES)}; '' for none")
    parser.add_argument("--static-from", action="append", type=existing_file, default=None, metavar="FILE",
                        help="a static calibration made elsewhere (`qada calibrate --out FILE`, checked against the "
                             "model), swept over --alphas as the family static:<file stem>; repeatable (default: "
                             "none)")
    parser.add_argument("--criterion", action="append", default=None, metavar="SPEC",
                        help="one more configuration in every cell: a criterion name, YAML/JSON mapping or file as "
                             "in `qada eval --criterion`, e.g. '{name: qada_budget, sparsity: 0.85}' (label "
                             "'qada_budget/stored sparsity=0.85': name, moments, parameters); repeatable, one point "
                             "each (default: none)")
    parser.add_argument("--criterion-moments", default="stored",
                        help="moment source (name, mapping or file) of the --criterion entries that need one")
    parser.add_argument("--no-oracle", action="store_true", help="leave out the oracle curve")
    parser.add_argument("--no-qada", action="store_true", help="leave out the QAdA curves (all --moments)")
    parser.add_argument("--calibration-samples", type=positive_int, default=None,
                        help="samples per other task for static_ruler calibration (default: --samples)")
    parser.add_argument("--record-oracle", action="store_true", help="also measure agreement with the oracle")
    parser.add_argument("--template", default="base", choices=["base", "chat"], help="prompt template")
    add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument("--out", required=True, help="results folder; a rerun reuses its finished results")
    parser.add_argument("--devices", type=positive_int, default=1,
                        help="processes (Lightning Fabric DDP: gloo on CPU, NCCL on GPUs, one per GPU with "
                             "--device cuda); samples are sharded")
    parser.add_argument("--report-only", action="store_true",
                        help="no decoding: tables, plots and the comparison from the finished per-sample results in "
                             "--out")
    parser.set_defaults(run=run)


def extra_configs(args: argparse.Namespace) -> list:
    """The ``--criterion`` entries as :class:`~qada.eval.configs.EvalConfig` (built and checked; labels unique)."""
    from qada.cli.common import build_eval_config, parse_component_spec
    from qada.eval.sweep import check_extra_labels

    configs = [build_eval_config(parse_component_spec(text), moments=args.criterion_moments)
               for text in args.criterion or ()]
    check_extra_labels(configs, args.taus, () if args.no_qada else split_moment_sources(args.moments),
                       not args.no_oracle)
    return configs


def check_static_from(paths: list[str] | None) -> None:
    """Each ``--static-from`` file is a static calibration (a head mask with its frequencies), before the model
    loads; the model fingerprint is checked once it has."""
    from qada.artifacts import read_artifact_info

    for path in paths or ():
        info = read_artifact_info(path)
        if info.kind != "head_mask" or "frequency" not in info.tensors:
            raise ValueError(f"--static-from {path!r} holds {info.kind!r} with tensors {sorted(info.tensors)}; "
                             "expected a static calibration from `qada calibrate` (a head mask with its "
                             "'frequency')")


def cells(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """``(tasks, lengths)`` to generate: the flags, their defaults, or none when only ``--data`` is given."""
    from qada.eval.tasks import TASKS

    if args.data and args.tasks is None and args.lengths is None:
        return [], []
    task_text = args.tasks if args.tasks is not None else DEFAULT_TASKS
    length_text = args.lengths if args.lengths is not None else DEFAULT_LENGTHS
    tasks = [t.strip() for t in task_text.split(",") if t.strip()]
    for task in tasks:
        TASKS.get(task)
    try:
        lengths = [int(x) for x in length_text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected --lengths to be comma-separated integers but got {length_text!r}") from None
    if not tasks or not lengths:
        raise ValueError(f"expected at least one task and one length but got --tasks {task_text!r} "
                         f"--lengths {length_text!r}")
    return tasks, lengths


def report(records: list[dict], out: str) -> None:
    """Print the table; write results.{json,csv,md}, the score-vs-sparsity plot and the comparison report."""
    import sys
    from pathlib import Path

    from qada.eval.compare import write_comparison
    from qada.eval.report import format_table, plot_score_vs_sparsity, write_results

    print(format_table(records))
    json_path, csv_path = write_results(records, out)
    plot = plot_score_vs_sparsity(records, Path(out) / "score_vs_sparsity.png")
    md, _, png = write_comparison(records, out, command="qada " + " ".join(sys.argv[1:]))
    print(f"wrote {json_path}, {csv_path}, {plot}, {md}, {png}")


def run(args: argparse.Namespace) -> int:
    from qada.eval.sweep import run_sweep
    from qada.models import load_model

    if args.report_only:
        from qada.eval.report import records_from_rows

        records = records_from_rows(args.out)
        if not records:
            raise FileNotFoundError(f"no results-rank*.jsonl under {args.out}")
        report(records, args.out)
        return 0
    from qada.eval.tasks import load_ruler_jsonl
    from qada.eval.validate import check_count, check_output_dir

    # checked before the model loads (run_sweep checks again, with the model: lengths vs. its positions)
    device, dtype = model_placement(args)
    fabric_devices(device, args.devices)
    check_count(args.samples, "--samples")
    check_output_dir(args.out, "--out")
    tasks, lengths = cells(args)
    for path in args.data or ():
        load_ruler_jsonl(path)  # empty, malformed or duplicated rows fail here, with the line number
    check_static_from(args.static_from)
    moment_sources = () if args.no_qada else split_moment_sources(args.moments)
    from qada.eval.configs import sweep_configs

    for config in sweep_configs(args.taus or [0.5], moment_sources):
        config.build()  # bad taus or moment-source parameters fail here
    criteria = extra_configs(args)
    fabric = make_fabric(device, args.devices)
    model, tokenizer = load_model(args.model, dtype=dtype, device=fabric.device)
    records = run_sweep(
        model, tokenizer, tasks, lengths, args.samples, args.out, taus=args.taus, alphas=args.alphas,
        moment_sources=moment_sources, static=args.static, calibration_samples=args.calibration_samples,
        record_oracle=args.record_oracle, seed=args.seed, template=args.template, fabric=fabric,
        progress=fabric.global_rank == 0, data_files=args.data or (), criteria=criteria,
        static_from=args.static_from or (), include_oracle=not args.no_oracle,
    )
    if fabric.global_rank != 0:
        return 0
    report(records, args.out)
    return 0
