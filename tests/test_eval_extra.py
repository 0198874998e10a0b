"""The ``eval`` extra: a missing Lightning, torchmetrics or matplotlib names it; the library never imports them."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from qada.eval._extra import EVAL_EXTRA, require_eval_extra

PACKAGE = Path(__file__).resolve().parents[1] / "qada"
MESSAGE = r"needs the 'eval' extra: pip install 'qada\[eval\]' \(missing: {}\)"


def _hide(monkeypatch, *names: str) -> None:
    """Make ``import name`` fail as if the package were not installed (``None`` in ``sys.modules``)."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_metrics_without_torchmetrics_names_the_extra(monkeypatch):
    _hide(monkeypatch, "torchmetrics", "torchmetrics.classification")
    for module in ("qada.eval.metrics", "qada.eval.evaluator"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=MESSAGE.format("torchmetrics")) as info:
        importlib.import_module("qada.eval.evaluator")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_evaluator_without_lightning_names_the_extra(monkeypatch, tmp_path):
    from qada.eval.evaluator import Evaluator

    _hide(monkeypatch, "lightning", "lightning.fabric")
    with pytest.raises(ImportError, match=MESSAGE.format("lightning")):
        Evaluator(None, None, [], tmp_path)


def test_plots_without_matplotlib_name_the_extra(monkeypatch, tmp_path):
    from qada.eval.plots import plot_curves
    from qada.eval.report import plot_score_vs_sparsity

    _hide(monkeypatch, "matplotlib", "matplotlib.pyplot")
    with pytest.raises(ImportError, match=MESSAGE.format("matplotlib")):
        plot_score_vs_sparsity([], tmp_path / "plot.png")
    with pytest.raises(ImportError, match=MESSAGE.format("matplotlib")):
        plot_curves([1.0], {"a": [0.5]}, "x", "y", tmp_path / "curves.png")


def test_require_eval_extra_returns_the_module():
    assert require_eval_extra("lightning.fabric").Fabric.__name__ == "Fabric"


def _third_party_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def test_only_eval_and_cli_import_the_extra():
    offending = [
        f"{path.relative_to(PACKAGE.parent).as_posix()}:{line} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in {"eval", "cli"}
        for line, name in _third_party_imports(path)
        if name.split(".")[0] in EVAL_EXTRA
    ]
    assert not offending, "the 'eval' extra is imported outside qada.eval / qada.cli:\n" + "\n".join(offending)
