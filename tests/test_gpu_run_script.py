"""``scripts/gpu-run.sh``, checked on the CPU: a lent GPU has 15 minutes in all, so a stage that names a row the GPU
suite does not build, or a section ``benchmarks/run.py`` does not know, must fail here, not there."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-run.sh"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def logical_lines(text: str) -> list[str]:
    """The script's lines with backslash continuations joined, comments dropped."""
    joined = re.sub(r"\\\n", "", text)
    return [line for line in joined.splitlines() if not line.lstrip().startswith("#")]


def row_lists(text: str) -> dict[str, list[str]]:
    """``NAME="a,b,c"`` assignments of the script -> their comma-separated names."""
    found = {}
    for line in logical_lines(text):
        match = re.fullmatch(r'\s*([a-z0-9_]+_rows)="([^"]*)"\s*', line)
        if match:
            found[match[1]] = match[2].split(",")
    return found


def run_calls(text: str) -> list[dict[str, str]]:
    """Every ``benchmarks/run.py`` call of a stage: its options (``--configs`` resolved through the row lists)."""
    rows = row_lists(text)
    calls = []
    for line in logical_lines(text):
        if "benchmarks/run.py" not in line:
            continue
        words = shlex.split(line.split("benchmarks/run.py", 1)[1].split(";;")[0])
        options = {}
        for key, value in zip(words, words[1:] + [""], strict=True):
            if key.startswith("--"):
                options[key] = value
        if "--configs" in options and options["--configs"].startswith("$"):
            options["--configs"] = ",".join(rows[options["--configs"].lstrip("$").strip("{}")])
        calls.append(options)
    return calls


def test_the_script_parses_its_own_row_lists():
    text = SCRIPT.read_text()
    rows = row_lists(text)
    assert {"smollm2_goal_rows", "lean_rows", "tail_rows", "pdl_rows"} <= set(rows)
    assert "qada_tail+E/lean fused compiled" in rows["lean_rows"]
    calls = run_calls(text)
    assert any(c.get("--only") == "bandwidth" for c in calls)
    lean = [c for c in calls if c.get("--configs", "").startswith("dense compiled,qada fused compiled,qada_tail fused")]
    assert lean and lean[0]["--models"] == "smollm2" and lean[0]["--batches"] == "${s#lean-b}"


def gpu_configs(model: str, batch: int) -> set[str]:
    """The row names the GPU suite builds for ``model`` at ``batch`` (no model loaded: rows are built lazily)."""
    from benchmarks.models import build_configs
    from benchmarks.suites import SUITES

    suite = SUITES["gpu"]
    (workload,) = [w for w in suite.e2e if w.model == model]
    shapes = {"smollm2": (30, 9, 3), "llama3-8b-random": (32, 32, 8)}[model]
    config = SimpleNamespace(num_hidden_layers=shapes[0], num_attention_heads=shapes[1],
                             num_key_value_heads=shapes[2])  # fmt: skip
    return set(build_configs(suite, workload, SimpleNamespace(config=config), None, batch))


def test_every_row_a_stage_names_is_built_by_the_gpu_suite():
    """Each stage's ``--configs`` names rows of the GPU suite's workload for its ``--models`` (at each batch size the
    stage may pass), and each ``--only`` names sections ``benchmarks/run.py`` knows."""
    from benchmarks.run import SECTIONS
    from benchmarks.suites import SUITES

    checked = 0
    for call in run_calls(SCRIPT.read_text()):
        assert set(call["--only"].split(",")) <= set(SECTIONS), call
        if "--configs" not in call:
            continue
        model = call["--models"]
        (workload,) = [w for w in SUITES["gpu"].e2e if w.model == model]
        batches = [int(call["--batches"])] if call.get("--batches", "$").isdigit() else list(workload.batches)
        for batch in batches:
            unknown = set(call["--configs"].split(",")) - gpu_configs(model, batch)
            assert not unknown, (model, batch, unknown)
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("stage", ["nope", "lean-b2"])
def test_an_unknown_stage_stops_before_running_anything(stage, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), stage], cwd=ROOT, capture_output=True, text=True,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)  # fmt: skip
    assert done.returncode == 2 and f"unknown stage {stage}" in done.stdout


def test_run_refuses_an_unknown_section_and_attention_with_bandwidth(tmp_path):
    from benchmarks.run import main

    with pytest.raises(SystemExit, match=r"--only: \['atention'\] not among the sections"):
        main(["--gpu", "--dry-run", "--only", "atention", "--out", str(tmp_path), "--quiet"])
    with pytest.raises(SystemExit, match="bandwidth is a part of attention"):
        main(["--gpu", "--dry-run", "--only", "attention,bandwidth", "--out", str(tmp_path), "--quiet"])
    assert not list(tmp_path.iterdir())  # refused before writing anything


def test_the_bandwidth_section_dry_run_times_the_triton_dense_path(tmp_path):
    """``--gpu --dry-run --only bandwidth``: copy bandwidth and the ``triton`` executor with every group dense (the
    goal's rows; graph-captured timings and the launch sweep are CUDA only, empty here), nothing else."""
    import json

    from benchmarks.run import main

    main(["--gpu", "--dry-run", "--only", "bandwidth", "--out", str(tmp_path), "--quiet"])
    data = json.loads((tmp_path / "gpu-dryrun-cpu-bandwidth.json").read_text())
    assert data["errors"] == [] and data["copy_bandwidth"]["bandwidth_gbs"] > 0
    assert {(r["executor"], r["local_groups"]) for r in data["attention"]} == {("dense_sdpa", 0), ("triton", 0)}
    assert all(r["max_abs_err_vs_reference"] < 1e-2 for r in data["attention"] if r["executor"] == "triton")
    assert data["dense_sweep"] == [] and "end_to_end" not in data


def test_an_interrupted_bandwidth_section_saves_the_rows_it_measured(tmp_path, monkeypatch):
    """The stage's time limit (SIGINT) during the launch sweep: the JSON keeps the dense rows already timed and says
    the section was interrupted; the interrupt goes on."""
    import json

    from benchmarks import attention
    from benchmarks.run import main

    def interrupted_sweep(*args, rows=None, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(attention, "dense_launch_sweep", interrupted_sweep)
    with pytest.raises(KeyboardInterrupt):
        main(["--gpu", "--dry-run", "--only", "bandwidth", "--out", str(tmp_path), "--quiet"])
    data = json.loads((tmp_path / "gpu-dryrun-cpu-bandwidth.json").read_text())
    assert data["errors"] == ["bandwidth: interrupted (KeyboardInterrupt)"]
    assert {r["executor"] for r in data["attention"]} == {"dense_sdpa", "triton"}


def test_every_test_file_a_stage_runs_exists():
    """The pytest stages (``tests``, ``fused``, ``fused-more``, ``graphs``, ``parity``) name test files that exist:
    a renamed file would make a lent GPU's stage collect nothing or fail at collection."""
    named = set()
    for line in logical_lines(SCRIPT.read_text()):
        if "-m pytest" in line:
            named.update(re.findall(r"tests/[A-Za-z0-9_]+\.py", line))
    assert {"tests/test_estimate_in_splits.py", "tests/test_moments_ahead.py", "tests/test_device_parity.py"} <= named
    missing = sorted(name for name in named if not (ROOT / name).is_file())
    assert not missing, missing


def run_stage(tmp_path, stage: str, **env: str) -> str:
    """``bash scripts/gpu-run.sh STAGE`` with ``env`` (no GPU, no python: ``PYTHON=true``); its printed lines."""
    done = subprocess.run(["bash", str(SCRIPT), stage], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHON": "true", **env})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def stage_limit(printed: str, stage: str) -> int:
    match = re.search(rf"=== {stage} \(limit (-?\d+)s\)", printed)
    assert match, printed
    return int(match[1])


def test_a_deadline_cuts_each_stage_to_end_before_the_call(tmp_path):
    """``DEADLINE`` (epoch seconds): a stage's limit is cut to end 30 s before it, one with under 30 s left is skipped
    (saying so) and runs nothing, and a limit already inside it stays."""
    import time

    ran, skipped = tmp_path / "ran", tmp_path / "skipped"
    now = int(time.time())
    assert stage_limit(run_stage(ran, "env"), "env") == 60  # no deadline: the stage's own limit
    assert (ran / "env.log").is_file()
    assert stage_limit(run_stage(ran, "env", DEADLINE=str(now + 1000)), "env") == 60
    cut = stage_limit(run_stage(ran, "env", DEADLINE=str(now + 100), LIMIT_env="500"), "env")
    assert 60 <= cut <= 70  # 100 s away less the 30 s kept to save and return (a few seconds may pass)
    printed = run_stage(skipped, "env", DEADLINE=str(now + 50))
    assert re.search(r"=== env skipped: \d+s left before DEADLINE", printed) and "=== env (limit" not in printed
    assert not (skipped / "env.log").exists()


def test_the_header_plan_fits_a_15_minute_session():
    """The header's device calls: each sets ``DEADLINE`` to its start plus its ``timeout_s`` less 10 s, and the fixed
    timeouts leave the machine's start (a minute or more) and the third call room in 900 s of device time."""
    header = SCRIPT.read_text().split("\nset -u\n", 1)[0]
    joined = re.sub(r"\\\n#\s*", "", header)
    calls = re.findall(r"run\(command=\"export DEADLINE=\$\(\( \$\(date \+%s\) \+ ([^)]+) \)\);.*?timeout_s=(\w+)\)",
                       joined)  # fmt: skip
    assert len(calls) == 3, calls
    fixed = []
    for offset, timeout in calls:
        if timeout.isdigit():
            assert int(offset) == int(timeout) - 10
            fixed.append(int(timeout))
        else:
            assert offset == f"{timeout} - 10"
    assert len(fixed) == 2 and sum(fixed) + 60 + 240 <= 900
