"""``qada analyze``: record one dense decoding run and write the paper's analyses (tables, head maps, curves)."""

from __future__ import annotations

import argparse
import shlex

from qada.cli.common import IMPORTS, HelpFormatter, add_model_arguments, existing_file, model_placement, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "analyze", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="log-error table (Table 2), head maps (Fig. 7), sparsity curves (Fig. 6); --compare: sweep comparison",
    )
    parser.add_argument("--task", default="niah_single_2", help="task to record on; context_free for paper §5")
    parser.add_argument("--length", type=positive_int, default=2048, help="prompt length in tokens")
    parser.add_argument("--samples", type=positive_int, default=3, help="prompts to record")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="decode steps per prompt (default: the answer's length + 4, stopping at EOS)")
    parser.add_argument("--moments", default="current", help="moment source behind the estimate")
    parser.add_argument("--tau", type=float, default=0.6, help="threshold for head maps and per-token sparsity")
    parser.add_argument("--criteria", action="append", default=None, metavar="SPEC",
                        help="a criterion whose decisions are compared with the oracle's at --tau on the recorded "
                             "steps (decision_diagnostics.md/json: recall of the oracle's dense heads, false-dense "
                             "rate, log error on dense heads, share of A_bulk in the exact set): a name (with "
                             "tau=--tau where it has one), a YAML/JSON mapping or a file; repeatable (default: qada, "
                             "qada_tail)")
    add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--compare", action="append", type=existing_file, default=None, metavar="RESULTS.json",
                        help="instead of recording: the comparison report of sweep results (comparison.md/json/png: "
                             "mean score over --auc-range per family, who dominates where, score vs sparsity and "
                             "kv_sparsity); repeatable, later files replace equal (task, length, label) records "
                             "(default: none)")
    parser.add_argument("--auc-range", type=sparsity_range, default="0.7,0.95",
                        help="sparsity interval LO,HI of the mean score and the dominance grid (steps of 0.05), "
                             "with --compare")
    parser.set_defaults(run=run)


DEFAULT_PROBES = ("qada", "qada_tail")


def probed_criteria(specs, tau: float) -> dict:
    """``label -> criterion`` of ``--criteria`` specs; a plain name gets ``tau`` where the criterion has one."""
    from qada.cli.common import parse_component_spec, spec_label
    from qada.criteria import CRITERIA

    probes = {}
    for text in specs:
        spec = parse_component_spec(text)
        if isinstance(spec, str):
            has_tau = any(name == "tau" for name, _, _ in CRITERIA.parameters(spec))
            spec = {"name": spec, "tau": tau} if has_tau else spec
        label = spec_label(spec)
        if label in probes:
            raise ValueError(f"--criteria {text!r} is given twice")
        probes[label] = CRITERIA.build(spec)
    return probes


def sparsity_range(text: str) -> tuple[float, float]:
    """An ``argparse`` type: ``"0.7,0.95"`` -> ``(0.7, 0.95)`` with ``0 <= lo < hi <= 1``."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two numbers) but got {text!r}") from None
    if not 0 <= lo < hi <= 1:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO < HI <= 1 but got {text!r}")
    return lo, hi


def compare(args: argparse.Namespace) -> int:
    """``--compare``: read sweep results, write the comparison report (no model)."""
    import json
    from pathlib import Path

    from qada.eval.compare import KV_READ_RANGE, comparison, write_comparison
    from qada.eval.validate import check_output_dir

    out = check_output_dir(args.out, "--out")
    merged: dict[tuple, dict] = {}
    for path in args.compare:
        try:
            records = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"--compare {path!r} is not JSON ({error})") from None
        needed = ("task", "length", "label", "family", "score", "sparsity")
        if not isinstance(records, list) or not all(isinstance(r, dict) and all(k in r for k in needed)
                                                    for r in records):
            raise ValueError(f"--compare {path!r}: expected a sweep's results.json (a list of records with "
                             f"{', '.join(needed)})")
        merged.update({(r["task"], r["length"], r["label"]): r for r in records})
    records = list(merged.values())
    lo, hi = args.auc_range  # argparse applies the type to the string default too
    md, json_path, png = write_comparison(records, out, lo, hi,
                                          command="qada analyze " + " ".join(f"--compare {p}" for p in args.compare))
    for axis, (a, b) in (("sparsity", (lo, hi)), ("kv_read", KV_READ_RANGE)):
        for row in comparison(records, a, b, axis=axis):
            scores = ", ".join(f"{f} {e['mean_score']:.1f}" for f, e in row["families"].items()
                               if e["mean_score"] is not None)
            print(f"{row['task']} @ {row['length']}: mean score over {axis} [{a}, {b}]: "
                  f"{scores or 'no family spans it'}")
    print(f"wrote {md}, {json_path}, {png}")
    return 0


def run(args: argparse.Namespace) -> int:
    import json

    if args.compare:
        return compare(args)
    from qada.criteria import CRITERIA
    from qada.eval.analysis import (
        DecisionLog,
        analysis_markdown,
        head_local_frequency,
        head_types,
        log_error_table,
        per_step_sparsity,
        sparsity_vs_tau,
    )
    from qada.eval.configs import paper_taus
    from qada.eval.decode import decode_greedy, prefill
    from qada.eval.diagnostics import CriterionProbe, decision_diagnostics, diagnostics_markdown
    from qada.eval.evaluator import answer_budget
    from qada.eval.plots import plot_curves, plot_head_maps
    from qada.eval.tasks import TASKS
    from qada.eval.validate import check_output_dir
    from qada.models import build_run, load_model, prepare_run

    device, dtype = model_placement(args)  # a missing GPU fails before any work
    out = check_output_dir(args.out, "--out")
    TASKS.get(args.task)
    probe = CriterionProbe(CRITERIA.build("dense"), probed_criteria(args.criteria or DEFAULT_PROBES, args.tau))
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    samples = TASKS.build(args.task).generate(tokenizer, args.length, args.samples, args.seed)
    log = DecisionLog()
    run = prepare_run(build_run(probe, args.moments, "sdpa", None, [log], compile=False), model, tokenizer)
    eos = {tokenizer.eos_token_id} - {None}
    for sample in samples:
        ids = tokenizer(sample.input, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
        budget = args.tokens or answer_budget(sample, tokenizer)
        prefilled = prefill(model, ids, run.criterion.prompt_queries())
        decode_greedy(model, prefilled, budget, eos if args.tokens is None else (), run)
        log.next_sequence()
    arrays = log.arrays()
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    table = log_error_table(arrays, args.seed)
    taus = paper_taus()
    curves = sparsity_vs_tau(arrays, taus)
    steps = per_step_sparsity(arrays, args.tau)
    maps = head_local_frequency(arrays, args.tau, L, H)
    types = {name: head_types(freq) for name, freq in maps.items()}
    meta = {"task": args.task, "length": args.length, "samples": len(samples), "moments": args.moments,
            "tau": args.tau, "records": int(len(arrays["t_bulk"]))}
    (out / "table2_log_error.json").write_text(json.dumps({**meta, "rows": table}, indent=2))
    command = (f"qada analyze --task {args.task} --length {args.length} --samples {args.samples} "
               f"--moments {args.moments} --tau {args.tau}")
    (out / "table2_log_error.md").write_text(analysis_markdown(command, meta["records"], table, types, args.tau))
    (out / "sparsity_vs_tau.json").write_text(json.dumps({**meta, **curves}, indent=2))
    (out / "per_token_sparsity.json").write_text(json.dumps({**meta, **steps}, indent=2))
    (out / "head_maps.json").write_text(json.dumps(
        {**meta, "long_context_frequency": {k: (1 - v).tolist() for k, v in maps.items()}, "head_types": types},
        indent=2))
    plot_head_maps({k: 1 - v for k, v in maps.items()}, out / "head_maps.png",
                   f"{args.task} @ {args.length}: fraction of steps each head needs long context (tau {args.tau})")
    plot_curves(curves["tau"], {"oracle": curves["oracle"], "qada": curves["qada"]}, "tau", "sparsity",
                out / "sparsity_vs_tau.png", f"sparsity vs tau ({args.task} @ {args.length})")
    plot_curves(steps["step"], {"oracle": steps["oracle"], "qada": steps["qada"]}, "decode step", "sparsity",
                out / "per_token_sparsity.png", f"per-token sparsity at tau {args.tau}")
    print(f"{meta['records']} (layer, step, head) records from {len(samples)} prompts of {args.task} @ {args.length}")
    print(f"{'selection':<26} {'n':>8} {'|log A_bulk - lognormal|':>26} {'|log A_bulk - log A_local|':>28}")
    for row in table:
        print(f"{row['selection']:<26} {row['n']:>8} {row['abs_log_error_lognormal']:>26.3f} "
              f"{row['abs_log_gap_bulk_vs_local']:>28.3f}")
    for name, t in types.items():
        print(f"head types ({name}, tau {args.tau}): " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
    diagnostics = decision_diagnostics(probe.arrays(), args.tau)
    (out / "decision_diagnostics.json").write_text(json.dumps({**meta, "rows": diagnostics}, indent=2))
    probes = " ".join(f"--criteria {shlex.quote(c)}" for c in args.criteria or ())
    (out / "decision_diagnostics.md").write_text(diagnostics_markdown(diagnostics, args.tau, f"{command} {probes}"))
    print(f"{'criterion':<32} {'sparsity':>9} {'kv_read':>8} {'recall':>7} {'false dense':>12} {'log error':>10} "
          f"{'E share':>8}")
    for row in diagnostics:
        cells = [row[k] for k in ("sparsity", "kv_read", "recall", "false_dense", "log_error_dense",
                                  "exact_share_dense")]
        print(f"{row['criterion']:<32} " + " ".join(f"{'-' if v is None else f'{v:.3f}':>{w}}"
                                                    for v, w in zip(cells, (9, 8, 7, 12, 10, 8), strict=True)))
    print(f"wrote {out}/table2_log_error.json, head_maps.png/json, sparsity_vs_tau.png/json, "
          "per_token_sparsity.png/json, decision_diagnostics.md/json")
    return 0
