"""The template strings, needle formats and task configs equal the ones RULER's package ships."""

from __future__ import annotations

import ast
import importlib

import yaml

from qada.eval.tasks import TASKS
from qada.eval.tasks.data import ruler_path
from qada.eval.tasks.templates import (
    MODEL_TEMPLATES,
    NIAH_NEEDLE,
    QA_DOCUMENT_PROMPT,
    REPEAT_HAYSTACK,
    TASK_TEMPLATES,
    VT_NOISE,
)


def _string_assignments(*parts: str) -> dict[str, list[str]]:
    """Every ``name = "literal"`` in one of RULER's generator scripts, read with ``ast``."""
    tree = ast.parse(ruler_path(*parts).read_text(encoding="utf-8"))
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(node.value.value)
    return found


def test_task_templates_equal_rulers():
    shipped = importlib.import_module("long_context_eval.data.synthetic.constants").TASKS
    assert TASK_TEMPLATES == shipped


def test_base_model_template_equals_rulers():
    shipped = importlib.import_module("long_context_eval.data.template").Templates
    assert MODEL_TEMPLATES["base"] == shipped["base"]


def test_needle_haystack_and_document_formats_equal_rulers():
    niah = _string_assignments("data", "synthetic", "niah.py")
    assert niah["needle"] == [NIAH_NEEDLE]
    assert REPEAT_HAYSTACK in niah["haystack"]
    assert _string_assignments("data", "synthetic", "variable_tracking.py")["noise"] == [VT_NOISE]
    assert _string_assignments("data", "synthetic", "qa.py")["DOCUMENT_PROMPT"] == [QA_DOCUMENT_PROMPT]


def test_task_configs_equal_synthetic_yaml():
    """Each task of RULER's synthetic.yaml is registered with the same arguments."""
    config = yaml.safe_load(ruler_path("synthetic.yaml").read_text(encoding="utf-8"))
    metrics = importlib.import_module("long_context_eval.eval.synthetic.constants").TASKS
    assert set(config) <= set(TASKS.names())
    for name, entry in config.items():
        task = TASKS.build(name)
        for arg, value in entry["args"].items():
            assert getattr(task, arg) == value, (name, arg)
        assert task.tokens_to_generate == TASK_TEMPLATES[entry["task"]]["tokens_to_generate"]
        assert task.metric == metrics[entry["task"]]["metric_fn"].__name__
