"""``qada moments``: build reference-prompt artifacts (keys or bucketed moments) and inspect artifact files."""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS, HelpFormatter, add_model_arguments, model_placement, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("moments", parents=[IMPORTS], formatter_class=HelpFormatter,
                            help="build and inspect reference-moment artifacts")
    actions = parser.add_subparsers(dest="moments_command", metavar="ACTION")
    parser.set_defaults(run=lambda args: parser.print_help() or 2)

    build = actions.add_parser(
        "build", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="run a reference prompt through a model and save its keys (or bucketed moments)",
        description="Run a reference prompt through the model in chunks (with the cache) and save its post-RoPE "
        "keys per layer and KV head as a safetensors artifact; with --buckets, save bucketed moments instead.",
    )
    build.add_argument("--prompt", default="random_words", help="reference prompt: random_words, text or single_word")
    build.add_argument("--length", type=positive_int, default=8192, help="reference length in tokens")
    build.add_argument("--out", required=True, help="output .safetensors file")
    build.add_argument("--buckets", type=positive_int, default=None, metavar="SIZE",
                       help="save moments every SIZE tokens (default: save the keys themselves)")
    add_model_arguments(build)
    build.add_argument("--seed", type=int, default=0, help="prompt seed")
    build.add_argument("--chunk-size", type=positive_int, default=1024, help="tokens per forward")
    build.add_argument("--t-sink", type=int, default=16, help="bulk start for --buckets")
    build.add_argument("--include-sinks", action="store_true", help="with --buckets, let the bulk start at 0")
    build.add_argument("--keys-dtype", choices=("float32", "float16"), default="float32",
                       help="dtype of the saved keys (float16 halves the file); --dtype is the model's")
    build.set_defaults(run=run_build)

    info = actions.add_parser("info", parents=[IMPORTS], formatter_class=HelpFormatter,
                              help="print what an artifact file holds")
    info.add_argument("file", help="a qada .safetensors artifact")
    info.set_defaults(run=run_info)


def run_build(args: argparse.Namespace) -> int:
    import torch

    from qada.models.loading import load_model
    from qada.moments.prompts import build_reference_prompt
    from qada.moments.reference import collect_reference_keys, compute_bucketed_moments

    device, dtype = model_placement(args)  # a missing GPU fails before any work
    if args.length < 1:
        raise ValueError(f"expected --length >= 1 but got {args.length}")
    if args.buckets is not None and args.buckets < 1:
        raise ValueError(f"expected --buckets >= 1 but got {args.buckets}")
    check_build_arguments(args)  # before the model loads and the reference runs
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    ids = build_reference_prompt(args.prompt, tokenizer, args.length, args.seed)
    info = {"prompt": args.prompt, "seed": args.seed, "model_path": args.model or "default"}
    keys_dtype = torch.float16 if args.keys_dtype == "float16" else torch.float32
    reference = collect_reference_keys(model, ids, args.chunk_size, progress=True, dtype=keys_dtype, info=info)
    if args.buckets is None:
        path = reference.save(args.out)
        print(f"saved reference keys {list(reference.keys.shape)} to {path}")
    else:
        first = 0 if args.include_sinks else args.t_sink
        data = compute_bucketed_moments(reference, args.buckets, first)
        path = data.save(args.out)
        print(f"saved bucketed moments at {len(data.ends)} lengths (bulk from {first}) to {path}")
    return 0


def check_build_arguments(args: argparse.Namespace) -> None:
    """Refuse what would only fail after the reference run: an unknown prompt kind, a bad bulk start, an output
    path that is a directory or ends in one."""
    from pathlib import Path

    from qada.moments.prompts import PROMPT_BUILDERS

    if args.prompt not in PROMPT_BUILDERS:
        raise ValueError(f"expected --prompt in {sorted(PROMPT_BUILDERS)} but got {args.prompt!r}")
    if args.t_sink < 0:
        raise ValueError(f"expected --t-sink >= 0 but got {args.t_sink}")
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"expected --out to be a file path but {args.out!r} is a directory")
    if any(parent.exists() and not parent.is_dir() for parent in out.parents):
        raise ValueError(f"expected --out inside a directory but a parent of {args.out!r} is a file")


def run_info(args: argparse.Namespace) -> int:
    """Print what the file holds after checking all of it: metadata, every tensor against the digest, and the
    content checks of its kind (shapes; finite keys; ordered bucket ends, PSD covariances; a bool mask)."""
    from qada.artifacts import load_head_mask, load_qada_correction, read_artifact_info
    from qada.moments import BucketedMomentsData, ReferenceKeys

    info = read_artifact_info(args.file)
    loaders = {"reference_keys": ReferenceKeys.load, "bucketed_moments": BucketedMomentsData.load,
               "head_mask": load_head_mask, "qada_correction": load_qada_correction}
    loaders[info.kind](args.file)  # reads every tensor: raises ArtifactError for a corrupted or inconsistent file
    print(info.describe())
    print("checked: digest and content OK")
    return 0
