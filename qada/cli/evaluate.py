"""``qada eval``: one configuration on one task (or a RULER jsonl), JSON out."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("eval", help="evaluate one configuration on a task or a RULER jsonl; writes JSON")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", help="task name (niah_single_1, vt, qa_1, ...)")
    source.add_argument("--data", help="a RULER-format jsonl ({'input', 'outputs'} per line)")
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens (with --task)")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--criterion", default="qada")
    parser.add_argument("--tau", type=float, default=None)
    parser.add_argument("--moments", default="stored")
    parser.add_argument("--executor", default="sdpa")
    parser.add_argument("--template", default="base", choices=["base", "chat"])
    parser.add_argument("--record-oracle", action="store_true", help="also measure agreement with the oracle")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from qada.eval.configs import EvalConfig
    from qada.eval.evaluator import Evaluator
    from qada.eval.report import format_table, result_record
    from qada.eval.tasks import TASKS, load_ruler_jsonl
    from qada.models import load_model

    model, tokenizer = load_model(args.model)
    if args.data:
        samples = load_ruler_jsonl(args.data, tokenizer=tokenizer)[: args.samples]
        task = samples[0].task if samples and samples[0].task else Path(args.data).stem
        length = samples[0].length if samples else None
    else:
        task_builder = TASKS.build(args.task, template=args.template)
        samples = task_builder.generate(tokenizer, args.length, args.samples, args.seed)
        task, length = args.task, args.length
    criterion: dict = {"name": args.criterion}
    if args.tau is not None:
        criterion["tau"] = args.tau
    moments = None if args.criterion in ("dense", "local", "oracle", "static") else args.moments
    family = args.criterion if moments is None else f"{args.criterion}/{moments}"
    config = EvalConfig(family if args.tau is None else f"{family} tau={args.tau}", criterion, moments,
                        args.executor, family=family)
    out = Path(args.out)
    evaluator = Evaluator(model, tokenizer, [config], out.with_suffix(".parts"), record_oracle=args.record_oracle)
    entry = next(iter(evaluator.evaluate(samples).values()))
    record = result_record(entry, task, length, len(samples), model, args.seed, {"template": args.template})
    out.write_text(json.dumps(record, indent=2))
    print(format_table([record]))
    print(f"wrote {out}")
    return 0
