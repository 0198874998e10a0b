"""``qada models``: list the embedded models, or print model cards (layers, heads, KV groups, kv_sparsity bounds).

A card reads a config only, never the weights: an embedded model's from the qada cache when it was loaded once,
else from its GGUF's metadata (a few seconds); a model directory's or a ``config.json``; or a transformers config
built from a model type, ``MODEL_TYPE:KEY=VALUE,...`` (``qwen2:num_key_value_heads=4,use_sliding_window=true``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from qada.cli.common import IMPORTS, HelpFormatter
from qada.eval.report import number_cell

_COLUMNS = ("kv_best", "kv_independent", "kv_worst")


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "models", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="list the embedded models; --card: a model's layers, heads and kv_sparsity bounds",
        description="List the embedded models (whether installed, license, install command) or, with --card, "
                    "print model cards: global and sliding-window layers, query and KV heads, group size, "
                    "head_dim, positions, and the kv_sparsity a head sparsity s gives, best case (s), heads "
                    "deciding independently (s**G) and worst case (max(0, 1 - G (1 - s))), over the global "
                    "layers and over all layers (sliding layers count as 1.0). Reads configs only, no weights.",
    )
    parser.add_argument(
        "--card", action="append", default=None, metavar="MODEL",
        help="an embedded model name, a model directory, a config.json or .gguf file, or MODEL_TYPE:KEY=VALUE,... "
             "(a transformers config built from a model type); repeatable (default: list the embedded models)",
    )
    parser.add_argument("--sparsities", type=sparsities, default="0.5,0.7,0.8,0.9,0.95",
                        help="head sparsities of the kv_sparsity table, comma-separated")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON instead of text")
    output.add_argument("--markdown", action="store_true",
                        help="print markdown (the tables of the docs' Supported models page)")
    parser.set_defaults(run=run)


def sparsities(text: str) -> tuple[float, ...]:
    """An ``argparse`` type: ``"0.5,0.9"`` -> ``(0.5, 0.9)``, each in [0, 1]."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers but got {text!r}") from None
    if not all(0.0 <= value <= 1.0 for value in values):
        raise argparse.ArgumentTypeError(f"expected head sparsities in [0, 1] but got {text!r}")
    return values


# ---------------------------------------------------------------------------------------------- the embedded list

def packages(install: str) -> list[str]:
    """The distributions a ``pip install --no-deps a==1 b==2`` command installs: ``["a", "b"]``."""
    words = install.split()[2:] if install.startswith("pip install") else install.split()
    return [word.split("==")[0] for word in words if not word.startswith("-")]


def missing_packages(install: str) -> list[str]:
    """The distributions of ``install`` whose module cannot be found (``find_spec``; nothing is imported)."""
    import importlib.util

    return [name for name in packages(install) if importlib.util.find_spec(name.replace("-", "_")) is None]


def embedded_list() -> list[dict[str, Any]]:
    from qada.models.loading import DEFAULT_MODEL, EMBEDDED_MODELS

    rows = []
    for name, model in EMBEDDED_MODELS.items():
        missing = missing_packages(model.install)
        rows.append({"name": name, "default": name == DEFAULT_MODEL, "description": model.description,
                     "license": model.license, "install": model.install, "installed": not missing,
                     "missing": missing})
    return rows


def format_list(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| model | installed | description | license | install |", "|---|---|---|---|---|"]
        lines += [f"| `{row['name']}` | {'yes' if row['installed'] else 'no'} | {row['description']} | "
                  f"{row['license']} | `{row['install']}` |" for row in rows]
        return "\n".join(lines)
    width = max(len(row["name"]) for row in rows) + 2
    lines = []
    for row in rows:
        state = "installed" if row["installed"] else f"not installed (missing {', '.join(row['missing'])})"
        lines += [f"{row['name']:<{width}}{row['description']}", f"{'':<{width}}{state}",
                  f"{'':<{width}}license: {row['license']}", f"{'':<{width}}install: {row['install']}"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ reading configs

def embedded_config(name: str) -> Any:
    """An embedded model's config, without dequantising its weights: from the qada cache if it was loaded once,
    else from the GGUF's metadata (transformers reads it in a few seconds)."""
    from transformers import AutoConfig

    from qada.models.loading import EMBEDDED_MODELS
    from qada.models.model_cache import entry_path

    gguf = EMBEDDED_MODELS[name].gguf_path()
    cached = entry_path(gguf, EMBEDDED_MODELS[name].sha256)
    if (cached / "config.json").is_file():
        return AutoConfig.from_pretrained(cached)
    print(f"[qada] reading the config of {gguf.name} (a few seconds)", file=sys.stderr, flush=True)
    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _value(text: str) -> Any:
    """``"4"`` -> 4, ``"true"`` -> True, ``"null"`` -> None, ``"[1, 2]"`` -> [1, 2]; other text stays a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def config_from_type(spec: str) -> Any:
    """``"qwen2:num_key_value_heads=4,use_sliding_window=true"`` -> ``AutoConfig.for_model("qwen2", ...)``."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, _, rest = spec.partition(":")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"expected a transformers model type before ':' but got {model_type!r}")
    values = {}
    for item in filter(None, rest.split(",")):
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE in {spec!r} but got {item!r}")
        values[key.strip()] = _value(text.strip())
    return AutoConfig.for_model(model_type, **values)


def card_config(spec: str) -> Any:
    """The config behind ``--card SPEC`` (see the module docstring)."""
    from pathlib import Path

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from qada.models.loading import EMBEDDED_MODELS

    if spec in EMBEDDED_MODELS:
        return embedded_config(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"expected a model directory with a config.json but {path} has none")
        return AutoConfig.from_pretrained(path)
    if path.is_file():
        if path.suffix == ".gguf":
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        return AutoConfig.from_pretrained(path)
    if spec.partition(":")[0] in CONFIG_MAPPING:
        return config_from_type(spec)
    raise FileNotFoundError(
        f"expected an embedded model ({', '.join(EMBEDDED_MODELS)}), a model directory, a config.json or .gguf "
        f"file, or MODEL_TYPE:KEY=VALUE,... but {spec!r} is none of these"
    )


# ------------------------------------------------------------------------------------------------ printing cards

def _theta(value: float | None) -> str:
    return "-" if value is None else (f"{int(value)}" if float(value).is_integer() else f"{value:g}")


def card_facts(card) -> list[tuple[str, str]]:
    """``(label, text)`` lines of a card's header."""
    theta = _theta(card.rope_theta)
    if card.sliding_layers and card.rope_theta_sliding != card.rope_theta:
        theta += f" (global), {_theta(card.rope_theta_sliding)} (sliding)"
    return [("family", card.model_type), ("layers", card.describe_layers()), ("heads", card.describe_heads()),
            ("positions", str(card.max_positions)), ("RoPE theta", theta)]


def format_card(card, sparsities: tuple[float, ...]) -> str:
    lines = [card.name] + [f"  {label + ':':<12}{text}" for label, text in card_facts(card)]
    lines += ["", f"  kv_sparsity for a head sparsity s (G = {card.group_size}): best = s, "
                  "independent = s**G, worst = max(0, 1 - G (1 - s))",
              f"  {'':>6}  {'global layers':<20}  {'all layers (sliding = 1.0)'}",
              f"  {'s':>6}  {'best':>6} {'indep':>6} {'worst':>6}  "
              f"{'s':>6} {'best':>6} {'indep':>6} {'worst':>6}"]
    for row in card.table(sparsities):
        values = [row[key] for key in _COLUMNS]
        everywhere = [row[f"{key}_all_layers"] for key in ("sparsity", *_COLUMNS)]
        lines.append(f"  {row['sparsity']:>6.2f}  " + " ".join(f"{number_cell(v):>6}" for v in values) + "  "
                     + " ".join(f"{number_cell(v):>6}" for v in everywhere))
    return "\n".join(lines)


def format_card_markdown(card, sparsities: tuple[float, ...]) -> str:
    facts = "; ".join(text if label in ("layers", "heads") else f"{label} {text}"
                      for label, text in card_facts(card)[1:])
    lines = [f"`{card.name}` ({card.model_type}): {facts}.", "",
             "| head sparsity | kv best | kv independent | kv worst | sparsity, all layers | kv best, all layers "
             "| kv independent, all layers | kv worst, all layers |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in card.table(sparsities):
        cells = [f"{row['sparsity']:.2f}"] + [number_cell(row[key]) for key in _COLUMNS] + [
            number_cell(row[f"{key}_all_layers"]) for key in ("sparsity", *_COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.card:
        rows = embedded_list()
        print(json.dumps(rows, indent=2) if args.json else format_list(rows, markdown=args.markdown))
        return 0
    from qada.models.cards import model_card

    cards = [model_card(card_config(spec), name=spec) for spec in args.card]
    if args.json:
        print(json.dumps([card.to_dict(args.sparsities) for card in cards], indent=2))
    elif args.markdown:
        print("\n\n".join(format_card_markdown(card, args.sparsities) for card in cards))
    else:
        print("\n\n".join(format_card(card, args.sparsities) for card in cards))
    return 0
