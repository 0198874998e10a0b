"""The "Write your own criterion" page's example is real: extracted from the page and run through ``qada eval``."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "howto" / "custom_criterion.rst"


def example_source() -> str:
    """The code of the page's first ``.. testcode::`` block, dedented."""
    match = re.search(r"^\.\. testcode::\n\n((?:(?:   .*)?\n)+)", PAGE.read_text(), re.MULTILINE)
    assert match, "no testcode block on the page"
    return "\n".join(line[3:] for line in match.group(1).splitlines()).strip() + "\n"


def test_the_example_is_a_short_top_k_criterion():
    source = example_source()
    code = [line for line in source.splitlines() if line.strip()]
    assert '@register_criterion("topk")' in source
    assert len(code) - 1 <= 30, f"{len(code)} non-empty lines"




def _qada(args, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "qada", *args], capture_output=True, text=True, env=env, timeout=600)


def test_the_example_runs_through_qada_eval_import(tiny_model_dir, tmp_path):
    (tmp_path / "topk_example.py").write_text(example_source())
    listed = _qada(["criteria", "--import", "topk_example"], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^topk\b", listed.stdout, re.MULTILINE), listed.stdout
    results = {}
    for sparsity in (0.25, 0.75):
        out = tmp_path / f"topk-{sparsity}.json"
        done = _qada(["eval", "--import", "topk_example", "--criterion", f"{{name: topk, sparsity: {sparsity}}}",
                      "--task", "niah_single_2", "--length", "300", "--samples", "2", "--model", str(tiny_model_dir[0]),
                      "--out", str(out)], tmp_path)
        assert done.returncode == 0, done.stderr
        results[sparsity] = json.loads(out.read_text())
    for sparsity, record in results.items():
        assert record["criterion"] == {"name": "topk", "sparsity": sparsity}
        # 4 query heads per row: round(0.25 * 4) = 1 and round(0.75 * 4) = 3 heads local at every step
        assert record["sparsity"] == pytest.approx(sparsity)
    unknown = _qada(["eval", "--criterion", "topk", "--task", "niah_single_2", "--length", "300", "--samples", "1",
                     "--model", str(tiny_model_dir[0]), "--out", str(tmp_path / "x.json")], tmp_path)
    assert unknown.returncode != 0 and "unknown criterion 'topk'" in unknown.stderr
