"""Every public name of qada's packages appears in the API reference (docs/api/*.rst).

A name counts as documented when an autodoc directive targets it (``.. autoclass:: qada.criteria.QAdACriterion``,
at the package path or the defining module's), when a ``py:data`` directive declares it, or when an
``automodule`` directive (without ``:no-members:``) covers a module whose ``__all__`` lists it. The full
Sphinx builds (-W, doctests) run in scripts/test.sh; this check is cheap and runs with pytest.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

API_DIR = Path(__file__).resolve().parent.parent / "docs" / "api"
PACKAGES = [
    "qada.step", "qada.criteria", "qada.moments", "qada.attention", "qada.models", "qada.functional",
    "qada.functional.checks",
]
DIRECTIVE = re.compile(r"^\.\. (auto\w+|py:\w+):: *(\S+)((?:\n[ \t]+.*)*)", re.MULTILINE)


def _directives() -> list[tuple[str, str, str, str]]:
    """``(directive, target, options, current module)`` for every directive in docs/api/*.rst."""
    found = []
    for path in sorted(API_DIR.glob("*.rst")):
        current = ""
        for match in DIRECTIVE.finditer(path.read_text()):
            kind, target, options = match.groups()
            if kind == "py:currentmodule":
                current = target
                continue
            found.append((kind, target, options, current))
    return found


def _documented() -> set[str]:
    names: set[str] = set()
    for kind, target, options, current in _directives():
        if kind == "automodule":
            if ":no-members:" in options:
                continue
            module = importlib.import_module(target)
            excluded = (
                set(re.findall(r":exclude-members:\s*(.*)", options)[0].replace(",", " ").split())
                if (":exclude-members:" in options)
                else set()
            )
            names.update(f"{target}.{name}" for name in getattr(module, "__all__", ()) if name not in excluded)
        elif kind.startswith("py:") and current and "." not in target:
            names.add(f"{current}.{target}")
        else:
            names.add(target)
    return names


def _qualified(package: str, name: str) -> set[str]:
    """The paths under which ``package.name`` may be documented: the package's and the defining module's."""
    paths = {f"{package}.{name}"}
    obj = getattr(importlib.import_module(package), name)
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and module.startswith("qada"):
        paths.add(f"{module}.{name}")
    return paths


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_in_the_api_reference(package):
    documented = _documented()
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not (_qualified(package, name) & documented)]
    assert not missing, f"{package}: public names missing from docs/api/*.rst: {missing}"


def test_the_check_sees_a_missing_name():
    assert "qada.criteria.NoSuchCriterion" not in _documented()
    assert "qada.criteria.QAdACriterion" in _documented()
