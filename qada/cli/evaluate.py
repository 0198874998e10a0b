"""``qada eval``: one configuration on one task (or a RULER jsonl), JSON out."""

from __future__ import annotations

import argparse

from qada.cli.common import (
    IMPORTS,
    HelpFormatter,
    add_model_arguments,
    add_run_arguments,
    existing_file,
    model_placement,
    positive_int,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="evaluate one configuration on a task or a RULER jsonl; writes JSON",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", help="task name (niah_single_1, vt, qa_1, ...)")
    source.add_argument("--data", type=existing_file, help="a RULER-format jsonl ({'input', 'outputs'} per line)")
    parser.add_argument("--length", type=positive_int, default=4096, help="prompt length in tokens, with --task")
    parser.add_argument("--samples", type=positive_int, default=10, help="samples to evaluate")
    add_run_arguments(parser, "eval")
    parser.add_argument("--template", default="base", choices=["base", "chat"], help="prompt template of --task")
    parser.add_argument("--record-oracle", action="store_true", help="also measure agreement with the oracle")
    add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument("--out", default=None,
                        help="JSON file to write (per-sample results go to OUT.parts/) (default: "
                             "qada-eval/MODEL-TASK-LENGTH-CRITERION.json in the current folder)")
    parser.set_defaults(run=run)


def eval_config(args: argparse.Namespace):
    """The :class:`~qada.eval.configs.EvalConfig` of the command line (``--config`` file, then the flags).

    The criterion is built once here to ask what it needs: moments go with it only if ``needs_moments``.
    """
    from pathlib import Path

    from qada.cli.common import build_eval_config, load_run_config, resolve_spec, static_mask_spec

    file_config = load_run_config(args.config)
    static = getattr(args, "static", None)
    if static is not None:
        if args.tau is not None:
            raise ValueError("--tau goes with a criterion name, not with --static (a static mask has no threshold)")
        spec = static_mask_spec(static)  # a bad file fails here, before the model loads
    else:
        spec = resolve_spec(args.criterion, file_config, "criterion", "qada")
    label = f"static {Path(static).name}" if static is not None else None
    return build_eval_config(spec, args.tau, args.moments, args.executor, file_config, label=label)


def default_out(args: argparse.Namespace, label: str) -> str:
    """``qada-eval/<model>-<task or data file>-<length>-<configuration>.json``, names made path-safe."""
    import re
    from pathlib import Path

    model = args.model if args.model is not None else "smollm2-135m"
    what = Path(args.data).stem if args.data else f"{args.task}-{args.length}"
    name = "-".join(re.sub(r"[^A-Za-z0-9_.=-]+", "_", Path(part).name if part == model else part).strip("_")
                    for part in (model, what, label))
    return str(Path("qada-eval") / f"{name}.json")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qada.eval.evaluator import Evaluator
    from qada.eval.identity import file_digest
    from qada.eval.report import format_table, result_record
    from qada.eval.results_file import ResultsFile, write_json
    from qada.eval.tasks import TASKS, load_ruler_jsonl
    from qada.eval.validate import check_count, check_length_fits, check_output_dir, check_output_file
    from qada.models import load_model

    # everything that can be checked before the model loads: a bad input fails in a second, not after the run
    device, dtype = model_placement(args)
    config = eval_config(args)
    check_count(args.samples, "--samples")
    out = check_output_file(args.out if args.out is not None else default_out(args, config.label), "--out")
    parts = check_output_dir(out.with_suffix(".parts"), "the results folder of --out")
    ResultsFile(parts / "results-rank0.jsonl").probe()
    if args.data:
        load_ruler_jsonl(args.data)  # empty, malformed or duplicated rows fail here, with the line number
    else:
        task_builder = TASKS.build(args.task, template=args.template)
        check_count(args.length, "--length")
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    if getattr(args, "static", None) is not None:
        from qada.cli.common import static_mask_spec

        static_mask_spec(args.static, model)  # made for this model (its fingerprint), else a clear error
    if args.data:
        samples = load_ruler_jsonl(args.data, tokenizer=tokenizer)[: args.samples]
        task = samples[0].task or Path(args.data).stem
        length = samples[0].length
        data = {"file": str(args.data), "digest": file_digest(args.data)}
    else:
        check_length_fits(args.length, model)
        samples = task_builder.generate(tokenizer, args.length, args.samples, args.seed)
        task, length, data = args.task, args.length, {"task": args.task, "length": args.length}
    settings = {"seed": args.seed, "template": args.template, "data": data}
    evaluator = Evaluator(model, tokenizer, [config], parts, record_oracle=args.record_oracle, settings=settings)
    entry = next(iter(evaluator.evaluate(samples).values()))
    record = result_record(entry, task, length, len(samples), model, args.seed, {"template": args.template})
    write_json(out, record)
    print(format_table([record]))
    print(f"wrote {out}")
    return 0
