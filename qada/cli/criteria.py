"""``qada criteria``: list every registered criterion with its parameters."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("criteria", help="list the registered head criteria and their parameters")
    parser.set_defaults(run=run)


def describe(registry) -> str:
    lines = []
    for name in registry.names():
        cls = registry.get(name)
        params = ", ".join(
            f"{pname}: {ptype}" + ("" if default is ... else f" = {default!r}")
            for pname, ptype, default in registry.parameters(name)
        )
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        lines.append(f"{name:<16} ({params})\n{'':<16} {doc}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from qada.criteria import CRITERIA

    print(describe(CRITERIA))
    return 0
