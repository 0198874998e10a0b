"""``qada moments``: build reference-prompt artifacts (keys or bucketed moments) and inspect artifact files."""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("moments", parents=[IMPORTS], help="build and inspect reference-moment artifacts")
    actions = parser.add_subparsers(dest="moments_command", metavar="ACTION")
    parser.set_defaults(run=lambda args: parser.print_help() or 2)

    build = actions.add_parser(
        "build", parents=[IMPORTS],
        help="run a reference prompt through a model and save its keys (or bucketed moments)",
        description="Run a reference prompt through the model in chunks (with the cache) and save its post-RoPE "
        "keys per layer and KV head as a safetensors artifact; with --buckets, save bucketed moments instead.",
    )
    build.add_argument("--prompt", default="random_words", help="random_words (default), text or single_word")
    build.add_argument("--length", type=int, default=8192, help="reference length in tokens (default 8192)")
    build.add_argument("--out", required=True, help="output .safetensors file")
    build.add_argument("--buckets", type=int, default=None, metavar="SIZE", help="save moments every SIZE tokens")
    build.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    build.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    build.add_argument("--chunk-size", type=int, default=1024, help="tokens per forward (default 1024)")
    build.add_argument("--t-sink", type=int, default=16, help="bulk start for --buckets (default 16)")
    build.add_argument("--include-sinks", action="store_true", help="with --buckets, let the bulk start at 0")
    build.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="dtype of saved keys")
    build.set_defaults(run=run_build)

    info = actions.add_parser("info", parents=[IMPORTS], help="print what an artifact file holds")
    info.add_argument("file", help="a qada .safetensors artifact")
    info.set_defaults(run=run_info)


def run_build(args: argparse.Namespace) -> int:
    import torch

    from qada.models.loading import load_model
    from qada.moments.prompts import build_reference_prompt
    from qada.moments.reference import collect_reference_keys, compute_bucketed_moments

    if args.length < 1:
        raise ValueError(f"expected --length >= 1 but got {args.length}")
    if args.buckets is not None and args.buckets < 1:
        raise ValueError(f"expected --buckets >= 1 but got {args.buckets}")
    model, tokenizer = load_model(args.model)
    ids = build_reference_prompt(args.prompt, tokenizer, args.length, args.seed)
    info = {"prompt": args.prompt, "seed": args.seed, "model_path": args.model or "default"}
    dtype = torch.float16 if args.dtype == "float16" else torch.float32
    reference = collect_reference_keys(model, ids, args.chunk_size, progress=True, dtype=dtype, info=info)
    if args.buckets is None:
        path = reference.save(args.out)
        print(f"saved reference keys {list(reference.keys.shape)} to {path}")
    else:
        first = 0 if args.include_sinks else args.t_sink
        data = compute_bucketed_moments(reference, args.buckets, first)
        path = data.save(args.out)
        print(f"saved bucketed moments at {len(data.ends)} lengths (bulk from {first}) to {path}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from qada.artifacts import read_artifact_info

    print(read_artifact_info(args.file).describe())
    return 0
