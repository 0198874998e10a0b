"""The layering contract of the ``qada`` package, checked on the source with :mod:`ast`.

Lowest layer first (docs/architecture.rst draws the same picture)::

    base       qada.functional, qada.window, qada.registry, qada.cache, qada.version, qada.artifacts,
               qada.stable_tensors
    step       qada.step                                  (the decode step of one layer, BulkMoments)
    criteria | moments | attention                        (siblings: none imports another)
    models     the transformers wrapper, model loading
    eval       tasks, evaluator, metrics, analysis, plots
    cli        the command line (qada/__main__.py too)

A module may import its own layer and the layers below it, never one above or a sibling. Inside ``base``,
``qada.functional`` is stricter: it imports nothing from qada except ``qada.window`` and itself, so the math
can be read (and reused) on its own. ``qada/__init__.py`` is the public facade and is exempt; importing the
facade (``import qada``, ``from qada import apply``) from inside the package counts as importing the top layer.

Every ``import`` is checked wherever it stands (module level, inside functions, under ``TYPE_CHECKING``),
relative imports are resolved, and so are ``importlib.import_module("qada....")`` calls with a literal name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qada"

# layer name -> (rank, top-level names of qada that belong to it); ranks order the layers, equal ranks with
# different names are siblings that may not import each other.
LAYERS: dict[str, tuple[int, tuple[str, ...]]] = {
    "functional": (0, ("functional",)),
    "base": (0, ("window", "registry", "cache", "version", "artifacts", "stable_tensors")),
    "step": (1, ("step",)),
    "criteria": (2, ("criteria",)),
    "moments": (2, ("moments",)),
    "attention": (2, ("attention",)),
    "models": (3, ("models", "testing")),  # qada.testing: checks of a user's components on the layer step
    "eval": (4, ("eval",)),
    "cli": (5, ("cli", "__main__")),
    "integrations": (6, ("integrations",)),  # qada inside other tools (lm-eval): builds on the command line's parsing
    "facade": (7, ("",)),  # `import qada` / `from qada import x` where x is not a submodule
}
# what each layer may import, beyond its own package (a package always imports itself)
ALLOWED: dict[str, frozenset[str]] = {
    "functional": frozenset({"functional", "base:window"}),
    "base": frozenset({"functional", "base"}),
    "step": frozenset({"functional", "base", "step"}),
    "criteria": frozenset({"functional", "base", "step", "criteria"}),
    "moments": frozenset({"functional", "base", "step", "moments"}),
    "attention": frozenset({"functional", "base", "step", "attention"}),
    "models": frozenset({"functional", "base", "step", "criteria", "moments", "attention", "models"}),
    "eval": frozenset({"functional", "base", "step", "criteria", "moments", "attention", "models", "eval"}),
    "cli": frozenset(LAYERS) - {"integrations"},
    "integrations": frozenset(LAYERS),
}
EXEMPT = {"qada/__init__.py"}
_TOP_TO_LAYER = {top: name for name, (_, tops) in LAYERS.items() for top in tops}


def display_layer(layer: str) -> str:
    return "base" if layer == "functional" else layer


@dataclass(frozen=True)
class Import:
    path: str  # "qada/x/y.py"
    line: int
    target: str  # "qada.y.z" or "qada"


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    target: str
    layer: str
    target_layer: str

    def __str__(self) -> str:
        if self.layer == "functional" and self.target_layer != "functional":
            why = "qada.functional may import only qada.window and itself"
        else:
            why = f"layer {display_layer(self.layer)} may not import layer {display_layer(self.target_layer)}"
        return f"{self.path}:{self.line} imports {self.target} ({why})"


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_submodule(package: Path, dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    base = package / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _literal_prefix(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value.rstrip(".")  # "qada.cli.{name}" -> "qada.cli"
    return None


def imports_of(path: Path, package: Path) -> list[Import]:
    """Every import of the package ``package`` (its top-level name) made by the file ``path``."""
    top = package.name
    rel_path = path.relative_to(package.parent).as_posix()
    name = module_name(path, package)
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []

    def add(line: int, target: str) -> None:
        if target == top or target.startswith(top + "."):
            found.append(Import(rel_path, line, target))

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = here[: len(here) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                add(node.lineno, candidate if alias.name != "*" and _is_submodule(package, candidate) else base)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if fname in {"import_module", "__import__"}:
                literal = _literal_prefix(node.args[0])
                if literal:
                    add(node.lineno, literal)
    return found


def layer_of(dotted: str) -> str | None:
    parts = dotted.split(".")
    return _TOP_TO_LAYER.get(parts[1] if len(parts) > 1 else "")


def check_package(package: Path, exempt: set[str] = EXEMPT) -> tuple[list[Violation], list[str]]:
    """Return the violations of the contract and the modules that belong to no layer."""
    violations: list[Violation] = []
    unassigned: list[str] = []
    for path in sorted(package.rglob("*.py")):
        rel_path = path.relative_to(package.parent).as_posix()
        if rel_path in exempt:
            continue
        layer = layer_of(module_name(path, package))
        if layer is None or layer == "facade":
            unassigned.append(rel_path)
            continue
        own_top = module_name(path, package).split(".")[1]
        for imp in imports_of(path, package):
            target_layer = layer_of(imp.target)
            target_top = imp.target.split(".")[1] if "." in imp.target else ""
            if target_top == own_top:
                continue
            if target_layer is None:
                unassigned.append(f"{imp.target} (imported at {imp.path}:{imp.line})")
                continue
            allowed = ALLOWED[layer]
            if target_layer in allowed or f"{target_layer}:{target_top}" in allowed:
                continue
            violations.append(Violation(imp.path, imp.line, imp.target, layer, target_layer))
    return violations, unassigned


def test_every_module_belongs_to_a_layer():
    _, unassigned = check_package(PACKAGE)
    assert not unassigned, "modules outside the layering contract (add them to LAYERS):\n" + "\n".join(unassigned)


def test_layering_contract():
    violations, _ = check_package(PACKAGE)
    report = "\n".join(str(v) for v in violations)
    if report:
        print(report)
    assert not violations, f"{len(violations)} import(s) break the layering contract:\n{report}"


# --- the checker itself, on a made-up package -------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "qada"


def test_checker_finds_every_kind_of_import(tmp_path):
    package = _write(tmp_path, {
        "qada/__init__.py": "from qada.models import apply\n",
        "qada/window.py": "",
        "qada/registry.py": "",
        "qada/step.py": "from qada.window import Window\n",
        "qada/functional/__init__.py": "from qada.functional.masses import x\n",
        "qada/functional/masses.py": "from qada.window import Window\nfrom qada import registry\n",
        "qada/criteria/__init__.py": "from .base import HeadCriterion\n",
        "qada/criteria/base.py": (
            "from qada.step import DecodeStep\n"
            "from ..moments.types import BulkMoments\n"
            "def f():\n"
            "    import qada.attention.base\n"
        ),
        "qada/moments/__init__.py": "",
        "qada/moments/types.py": "from qada.step import BulkMoments\n",
        "qada/attention/__init__.py": "",
        "qada/attention/base.py": "import importlib\nimportlib.import_module('qada.models')\n",
        "qada/models/__init__.py": "from qada import criteria, moments, attention, step\n",
        "qada/eval/__init__.py": "from qada.models import apply\nfrom qada.cli import main\n",
        "qada/cli/__init__.py": "import qada\nfrom qada.eval import x\n",
        "qada/extra.py": "",
    })
    violations, unassigned = check_package(package)
    assert sorted(map(str, violations)) == sorted([
        "qada/functional/masses.py:2 imports qada.registry (qada.functional may import only qada.window and itself)",
        "qada/criteria/base.py:2 imports qada.moments.types (layer criteria may not import layer moments)",
        "qada/criteria/base.py:4 imports qada.attention.base (layer criteria may not import layer attention)",
        "qada/attention/base.py:2 imports qada.models (layer attention may not import layer models)",
        "qada/eval/__init__.py:2 imports qada.cli (layer eval may not import layer cli)",
    ])
    assert unassigned == ["qada/extra.py"]


@pytest.mark.parametrize(("source", "expected"), [
    ("from . import base\n", "qada.criteria.base"),
    ("from .base import X\n", "qada.criteria.base"),
    ("from .. import window\n", "qada.window"),
    ("from qada import apply\n", "qada"),
    ("import qada.models.run as run\n", "qada.models.run"),
    ("importlib.import_module(f'qada.cli.{name}')\n", "qada.cli"),
])
def test_checker_resolves_targets(tmp_path, source, expected):
    package = _write(tmp_path, {
        "qada/__init__.py": "", "qada/window.py": "", "qada/criteria/__init__.py": "",
        "qada/criteria/base.py": "", "qada/criteria/mod.py": source,
    })
    assert [imp.target for imp in imports_of(package / "criteria" / "mod.py", package)] == [expected]
