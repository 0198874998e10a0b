"""``qada generate``: generate from a prompt file with a chosen criterion and print a summary."""

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
        "generate", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="generate text with QAdA (or another criterion) and report sparsity",
    )
    parser.add_argument("--prompt-file", required=True, type=existing_file,
                        help="text file with the prompt (completion style)")
    add_model_arguments(parser)
    add_run_arguments(parser, "generate", executor="auto")
    parser.add_argument("--t-local", type=positive_int, default=None,
                        help="local window size (default: the --config file's, else 128)")
    parser.add_argument("--t-sink", type=int, default=None,
                        help="sink tokens in the window (default: the --config file's, else 16)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="torch seed, used with --sample")
    parser.add_argument("--per-layer", action="store_true", help="print sparsity and kv_sparsity per layer")
    parser.add_argument("--cache", default="static", choices=["static", "dynamic"],
                        help="KV cache: static = preallocated, written in place, faster; dynamic = "
                             "transformers' DynamicCache, grows by a copy every step")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from qada.cli.common import (
        build_criterion,
        load_run_config,
        resolve_moments,
        resolve_spec,
        spec_label,
        static_mask_spec,
    )
    from qada.criteria import DenseCriterion
    from qada.eval.report import number_cell
    from qada.models import enable, load_model
    from qada.models.generation import check_generation_length, generate_timed
    from qada.window import Window

    device, dtype = model_placement(args)  # a missing GPU fails first
    prompt = Path(args.prompt_file).read_text()
    if args.static is not None and args.tau is not None:
        raise ValueError("--tau goes with a criterion name, not with --static (a static mask has no threshold)")
    file_config = load_run_config(args.config)
    if args.static is not None:  # a readable head mask (fails before the model loads); checked against it below
        _, criterion = build_criterion(static_mask_spec(args.static))
    else:
        _, criterion = build_criterion(resolve_spec(args.criterion, file_config, "criterion", "qada"), args.tau)
    moments = resolve_moments(args.moments, file_config, criterion)
    executor = resolve_spec(args.executor, file_config, "executor", "auto")
    window_config = file_config.get("window") or {}
    if not isinstance(window_config, dict):
        Window.from_config(window_config)  # raises: a window is a mapping {t_local: ..., t_sink: ...}
    window_config = dict(window_config)
    window_config.update({k: v for k, v in (("t_local", args.t_local), ("t_sink", args.t_sink)) if v is not None})
    window = Window.from_config(window_config)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    if args.static is not None:
        static_mask_spec(args.static, model)  # raises if the mask was made for another model
    torch.manual_seed(args.seed)
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    # before any work (a stored reference may be built next): the prompt must fit the model
    check_generation_length(model, inputs["input_ids"].shape[1], args.max_new_tokens)
    run = None
    if not isinstance(criterion, DenseCriterion):  # dense: the unmodified model
        run = enable(model, criterion=criterion, moments=moments if moments is not None else "none",
                     executor=executor, window=window, tokenizer=tokenizer)
    try:
        output, timing = generate_timed(
            model, inputs["input_ids"], args.max_new_tokens, cache=args.cache,
            attention_mask=inputs.get("attention_mask"), do_sample=args.sample, pad_token_id=tokenizer.pad_token_id,
        )
    finally:
        if run is not None:
            run.remove()
    new_tokens = output[0, inputs["input_ids"].shape[1]:]
    print(tokenizer.decode(new_tokens, skip_special_tokens=True))
    print("---")
    rate = timing.decode_tokens_per_s
    print(f"prompt tokens: {inputs['input_ids'].shape[1]}  new tokens: {len(new_tokens)}  cache: {args.cache}  "
          f"prefill: {timing.prefill_s:.2f} s  decode: {timing.decode_s:.2f} s for {timing.decode_tokens} tokens  "
          f"decode tokens/s: {'n/a (one token)' if rate is None else f'{rate:.2f}'}")
    if run is None:
        print("criterion: dense (unmodified model)  sparsity: 0.000  kv_sparsity: 0.000")
        return 0
    summary = run.summary()
    if args.static is not None:  # not the whole [L, H] mask
        local, total = int(criterion.mask.sum()), criterion.mask.numel()
        described = f"static {args.static} ({local} of {total} heads local)"
    else:
        described = str(run.criterion.to_config())
    print(f"criterion: {described}  moments: {spec_label(moments) if moments is not None else None}  "
          f"executor: {spec_label(executor) if run.executor_choice is None else run.executor_choice}")
    print(f"sparsity: {number_cell(summary['sparsity'])}  kv_sparsity: {number_cell(summary['kv_sparsity'])}  "
          f"kv_read: {number_cell(summary.get('kv_read'))}  fail-safe fallbacks: {summary['fail_safe']}"
          + ("  (global layers)" if summary.get("sliding_layers") else ""))
    if summary.get("sliding_layers"):
        print(f"over all layers, the {len(summary['sliding_layers'])} sliding-window layers counted as local: "
              f"sparsity: {number_cell(summary['sparsity_all_layers'])}  "
              f"kv_sparsity: {number_cell(summary['kv_sparsity_all_layers'])}")
    if args.per_layer:
        print("layer  sparsity  kv_sparsity")
        for layer, value in summary["sparsity_per_layer"].items():
            print(f"{layer:>5}  {value:>8.3f}  {summary['kv_sparsity_per_layer'][layer]:>11.3f}")
    return 0
