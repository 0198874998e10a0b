"""``qada calibrate``: record oracle local frequencies on task prompts and save the static head mask, or (with
``--correction``) fit the per-head correction of QAdA's lognormal estimate for ``qada_calibrated``."""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS, HelpFormatter, add_model_arguments, existing_file, model_placement, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "calibrate", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="calibrate a static head mask (paper App. A) or a QAdA correction and save it",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tasks", help="comma-separated task names to calibrate on")
    source.add_argument("--data", type=existing_file, help="a RULER-format jsonl to calibrate on")
    parser.add_argument("--length", type=positive_int, default=2048, help="prompt length in tokens, with --tasks")
    parser.add_argument("--samples", type=positive_int, default=5, help="samples per task, or from --data")
    parser.add_argument("--tau-static", type=float, default=0.6,
                        help="oracle threshold whose local decisions are counted per head")
    parser.add_argument("--alpha", type=float, default=0.5, help="fraction of heads made local in the saved mask")
    parser.add_argument("--dense-decoding", action="store_true",
                        help="decode densely while recording (App. A for non-RULER prompts); else with the oracle "
                             "at --tau-static")
    parser.add_argument("--correction", action="store_true",
                        help="instead of a static mask, fit and save the per-head log-space correction of the "
                             "lognormal bulk estimate against the oracle's exact bulk mass (criterion "
                             "qada_calibrated, correction=OUT)")
    parser.add_argument("--moments", default="stored",
                        help="with --correction: moment source of the estimate to correct (name, mapping or file)")
    parser.add_argument("--ridge", type=float, default=1.0,
                        help="with --correction: pull of each head's fit toward the identity (slope 1, offset 0)")
    parser.add_argument("--quantile", type=float, default=None,
                        help="with --correction: fit each head's offset as this quantile of its residuals (e.g. 0.9: "
                             "the corrected estimate covers the exact bulk mass in 90%% of the steps) (default: the "
                             "least-squares mean offset)")
    add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument("--out", required=True,
                        help=".safetensors file (mask + frequencies + model fingerprint; use it with --static FILE), "
                             "or with --correction the correction (slope + offset + counts + model fingerprint)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import math

    from qada.cli.common import parse_component_spec
    from qada.eval.calibrate import calibrate_static, save_static_frequency
    from qada.eval.tasks import TASKS, load_ruler_jsonl
    from qada.eval.validate import check_output_file
    from qada.models import load_model

    # before the model loads and the calibration runs: the device, then the inputs
    device, dtype = model_placement(args)
    check_output_file(args.out, "--out")
    if args.data:
        load_ruler_jsonl(args.data)
    else:
        for task in (t for t in args.tasks.split(",") if t):
            TASKS.get(task)
    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"expected --alpha in [0, 1] but got {args.alpha}")
    if not 0.0 <= args.tau_static <= 1.0:
        raise ValueError(f"expected --tau-static in [0, 1] but got {args.tau_static}")
    if args.quantile is not None and not 0 < args.quantile < 1:
        raise ValueError(f"expected --quantile in (0, 1) but got {args.quantile}")
    if not (math.isfinite(args.ridge) and args.ridge >= 0):
        raise ValueError(f"expected --ridge to be a finite number >= 0 but got {args.ridge}")
    moments = parse_component_spec(args.moments) if args.correction else None
    if args.correction:
        from qada.moments import MOMENT_SOURCES

        MOMENT_SOURCES.build(moments)  # an unknown source fails before the model loads
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    if args.data:
        samples = load_ruler_jsonl(args.data, tokenizer=tokenizer)[: args.samples]
    else:
        samples = [s for task in args.tasks.split(",") if task
                   for s in TASKS.build(task).generate(tokenizer, args.length, args.samples, args.seed)]
    if args.correction:
        return _run_correction(args, model, tokenizer, samples, moments)
    frequency = calibrate_static(model, tokenizer, samples, args.tau_static, not args.dense_decoding)
    path = save_static_frequency(args.out, frequency, model, args.alpha,
                                 info={"tau_static": args.tau_static, "n": len(samples)})
    from qada.criteria import StaticCriterion
    from qada.functional.static import undecided_layers

    sliding = undecided_layers(frequency)  # a hybrid model's sliding-window layers: never decided, NaN rows
    decided = frequency[~sliding]
    local = int(StaticCriterion.from_frequency(frequency, args.alpha).mask[~sliding].sum())
    print(f"calibrated on {len(samples)} prompts; mean oracle local frequency {decided.mean():.3f}")
    where = ""
    if sliding.any():
        layers = (~sliding).nonzero().flatten().tolist()
        where = (f" of the {len(layers)} global layers {layers} (the {int(sliding.sum())} sliding-window layers pass "
                 "through qada)")
    print(f"saved {path}: static mask with {local} of {decided.numel()} heads local{where} (alpha {args.alpha})")
    return 0


def _run_correction(args: argparse.Namespace, model, tokenizer, samples, moments) -> int:
    from qada.eval.calibrate import calibrate_qada_correction, save_qada_correction_fit

    correction, recorded = calibrate_qada_correction(model, tokenizer, samples, moments, args.tau_static,
                                                     not args.dense_decoding, ridge=args.ridge,
                                                     quantile=args.quantile)
    info = {"tasks": args.tasks, "data": args.data, "length": args.length if args.tasks else None,
            "seed": args.seed, "n": len(samples), "moments": moments, "tau_static": args.tau_static,
            "decoding": "dense" if args.dense_decoding else "oracle", "ridge": args.ridge, "quantile": args.quantile,
            "records": int(recorded.t_bulk.numel())}
    path = save_qada_correction_fit(args.out, correction, model, info)
    before, after = recorded.abs_log_error(), recorded.abs_log_error(correction)
    print(f"calibrated on {len(samples)} prompts ({info['records']} decode steps with a bulk); mean abs log error "
          f"of the estimate on them {before:.3f} -> {after:.3f} corrected (evaluate on other prompts)")
    unfitted = (correction.count == 0).all(-1).nonzero().flatten().tolist()
    if unfitted:  # a hybrid model's sliding-window layers are never decided
        print(f"layer(s) {unfitted} had no decode decisions (sliding-window layers pass through qada): identity "
              "correction (slope 1, offset 0)")
    print(f"saved {path}: per-head correction [{correction.slope.shape[0]}, {correction.slope.shape[1]}]; use it "
          f"with --criterion '{{name: qada_calibrated, correction: {path}}}'")
    return 0
