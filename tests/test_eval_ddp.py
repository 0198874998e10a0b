"""A 2-process CPU run (Lightning Fabric DDP, gloo) gives the same metrics as one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(out: Path, devices: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PL_DISABLE_FORK": "1"}
    subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_eval_script.py"), str(out), str(devices)],
                   check=True, cwd=ROOT, env=env, timeout=600)
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
def test_two_process_ddp_equals_one_process(tmp_path):
    single = _run(tmp_path / "one", 1)
    double = _run(tmp_path / "two", 2)
    assert sorted(p.name for p in (tmp_path / "two").glob("results-rank*.jsonl")) == [
        "results-rank0.jsonl", "results-rank1.jsonl"]
    for label in ("dense", "qada"):
        for key in ("score", "sparsity", "kv_sparsity", "oracle_agreement"):
            if key in single[label]:
                assert double[label][key] == pytest.approx(single[label][key], abs=1e-6), (label, key)
    assert 0 < single["qada"]["sparsity"] < 1
