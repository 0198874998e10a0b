"""The ``qada`` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Every subcommand takes ``--import MODULE`` (repeatable, from :data:`qada.cli.common.IMPORTS`): the modules are
imported before the command runs, so the components they register can be named on the command line; and
``--no-compile``: every run the command builds decodes with its layer step eager (``compile=False``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from qada.version import __version__

# Subcommand modules, imported only when the command line is parsed (no work at import of qada).
SUBCOMMANDS = ("analyze", "calibrate", "criteria", "demo", "eval", "generate", "models", "moments", "sweep")


_MODULES = {"eval": "evaluate"}  # subcommand -> module, where the name is a Python builtin

#: Errors that mean the input was wrong (exit status 2); other ``RuntimeError`` / ``OSError`` exit with 1.
USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="qada",
        description="Query-adaptive long-context head identification: which attention heads need the whole "
        "context, per query.",
    )
    parser.add_argument("--version", action="version", version=f"qada {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"qada.cli.{_MODULES.get(name, name)}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        from qada.registry import import_modules

        import_modules(getattr(args, "imports", None) or [])
        if getattr(args, "no_compile", False):
            from qada.models.step_compile import COMPILE_ENV

            os.environ[COMPILE_ENV] = "0"  # every run this command builds (and any worker it starts) steps eagerly
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here rather than at interpreter exit
        return code
    except BrokenPipeError:  # `qada criteria | head`: the reader left, so stop quietly
        _silence_stdout()
        return 0
    except USAGE_ERRORS as error:  # bad input: exit status 2, as argparse's own usage errors
        print(f"qada {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as error:  # the input was fine but the work failed
        print(f"qada {args.command}: error: {error}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (e.g. captured in tests)
        pass
