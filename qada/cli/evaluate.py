"""``qada eval``: one configuration on one task (or a RULER jsonl), JSON out."""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval", parents=[IMPORTS], help="evaluate one configuration on a task or a RULER jsonl; writes JSON"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", help="task name (niah_single_1, vt, qa_1, ...)")
    source.add_argument("--data", help="a RULER-format jsonl ({'input', 'outputs'} per line)")
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens (with --task)")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML/JSON file with criterion, moments, executor, window (and imports); flags override")
    parser.add_argument("--criterion", default=None,
                        help="a criterion name, an inline YAML/JSON mapping or a .yaml/.json file (default qada)")
    parser.add_argument("--tau", type=float, default=None, help="tau for a criterion given by name")
    parser.add_argument("--moments", default=None,
                        help="moment source (name, mapping or file; default stored), used if the criterion needs it")
    parser.add_argument("--executor", default=None, help="attention executor (name, mapping or file; default sdpa)")
    parser.add_argument("--template", default="base", choices=["base", "chat"])
    parser.add_argument("--record-oracle", action="store_true", help="also measure agreement with the oracle")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.set_defaults(run=run)


def eval_config(args: argparse.Namespace):
    """The :class:`~qada.eval.configs.EvalConfig` of the command line (``--config`` file, then the flags).

    The criterion is built once here to ask what it needs: moments go with it only if ``needs_moments``.
    """
    from qada.cli.common import (
        build_criterion,
        component_name,
        load_run_config,
        resolve_moments,
        resolve_spec,
        spec_label,
    )
    from qada.criteria import DenseCriterion
    from qada.eval.configs import EvalConfig

    file_config = load_run_config(args.config)
    criterion_config, criterion = build_criterion(
        resolve_spec(args.criterion, file_config, "criterion", "qada"), args.tau
    )
    moments = resolve_moments(args.moments, file_config, criterion)
    executor = resolve_spec(args.executor, file_config, "executor", "sdpa")
    window = dict(file_config.get("window") or {"t_local": 128, "t_sink": 16})
    name = component_name(criterion_config)
    if isinstance(criterion, DenseCriterion):
        family = "dense"  # the evaluator runs the unmodified model
    else:
        family = name if moments is None else f"{name}/{spec_label(moments, sep=':')}"
    label = family + spec_label(criterion_config)[len(name):]  # e.g. "qada/stored tau=0.3", "any_of#1a2b3c4d"
    return EvalConfig(label, criterion_config, moments, executor, window, family=family)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from qada.eval.evaluator import Evaluator
    from qada.eval.report import format_table, result_record
    from qada.eval.tasks import TASKS, load_ruler_jsonl
    from qada.models import load_model

    config = eval_config(args)  # before the model loads: a bad spec fails fast
    model, tokenizer = load_model(args.model)
    if args.data:
        samples = load_ruler_jsonl(args.data, tokenizer=tokenizer)[: args.samples]
        task = samples[0].task if samples and samples[0].task else Path(args.data).stem
        length = samples[0].length if samples else None
    else:
        task_builder = TASKS.build(args.task, template=args.template)
        samples = task_builder.generate(tokenizer, args.length, args.samples, args.seed)
        task, length = args.task, args.length
    out = Path(args.out)
    evaluator = Evaluator(model, tokenizer, [config], out.with_suffix(".parts"), record_oracle=args.record_oracle)
    entry = next(iter(evaluator.evaluate(samples).values()))
    record = result_record(entry, task, length, len(samples), model, args.seed, {"template": args.template})
    out.write_text(json.dumps(record, indent=2))
    print(format_table([record]))
    print(f"wrote {out}")
    return 0
