"""``qada criteria``: list every registered criterion with its parameters and what it needs."""

from __future__ import annotations

import argparse

from qada.cli.common import IMPORTS, HelpFormatter


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "criteria", parents=[IMPORTS], formatter_class=HelpFormatter,
        help="list the registered head criteria, their parameters and what they need",
    )
    parser.set_defaults(run=run)


_NEEDS = (("needs_moments", "moments"), ("needs_full_scores", "full scores"),
          ("needs_calibration", "calibration artifact"))


def needs_of(cls: type) -> str:
    """What a criterion class declares it needs: ``"moments"``, ``"nothing"``, or ``"what its children need"``.

    Composites compute their needs from their children (properties on the instance), so the class says only that.
    """
    import inspect

    if any(isinstance(inspect.getattr_static(cls, attr, None), property) for attr, _ in _NEEDS):
        return "what its criteria need"
    needed = [label for attr, label in _NEEDS if getattr(cls, attr, False) is True]
    return ", ".join(needed) or "nothing"


def describe(registry) -> str:
    lines = []
    for name in registry.names():
        cls = registry.get(name)
        params = ", ".join(
            f"{pname}: {ptype}" + ("" if default is ... else f" = {default!r}")
            for pname, ptype, default in registry.parameters(name)
        )
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        lines.append(f"{name:<16} ({params})\n{'':<16} {doc}\n{'':<16} needs: {needs_of(cls)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from qada.criteria import CRITERIA

    print(describe(CRITERIA))
    return 0
