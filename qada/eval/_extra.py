"""The ``eval`` extra: third-party packages only :mod:`qada.eval` (and the commands built on it) needs.

Lightning (the evaluator's Fabric), torchmetrics (the metrics) and matplotlib (the plots) come with
``pip install 'qada[eval]'``; nothing below :mod:`qada.eval` imports them. Import them through
:func:`require_eval_extra`, or turn a failed import into :func:`eval_extra_error`, so a missing package says
which extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["EVAL_EXTRA", "eval_extra_error", "pyplot", "require_eval_extra"]

EVAL_EXTRA = ("lightning", "torchmetrics", "matplotlib")


def eval_extra_error(error: ModuleNotFoundError, module_name: str | None = None) -> ImportError:
    """The ImportError to raise (``from error``) when an import of the ``eval`` extra failed."""
    missing = (error.name or module_name or "?").split(".")[0]  # the distribution to install, not the submodule
    return ImportError(f"qada's evaluation needs the 'eval' extra: pip install 'qada[eval]' (missing: {missing})")


def require_eval_extra(module_name: str) -> ModuleType:
    """Import and return ``module_name`` (e.g. ``"lightning.fabric"``).

    Raises:
        ImportError: the module or a package it needs is not installed; the message names the ``eval`` extra.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise eval_extra_error(error, module_name) from error


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (figures are only written to files)."""
    matplotlib = require_eval_extra("matplotlib")
    matplotlib.use("Agg")
    return require_eval_extra("matplotlib.pyplot")
