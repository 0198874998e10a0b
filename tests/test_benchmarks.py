"""The benchmark suite's plumbing on tiny shapes (1 repetition): it runs and writes the expected JSON/markdown.

No timing assertions: performance goals live in ``benchmarks/``, not in tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.run import main
    finally:
        sys.path.remove(str(ROOT))
    out = tmp_path_factory.mktemp("bench")
    main(["--smoke", "--out", str(out), "--quiet"])
    return out


def test_smoke_writes_json_and_markdown(smoke):
    data = json.loads((smoke / "smoke-cpu.json").read_text())
    assert {"suite", "command", "machine", "settings", "attention", "overhead", "end_to_end", "goals"} <= set(data)
    assert data["errors"] == []
    for key in ("cpu", "cores", "torch", "transformers", "qada", "date"):
        assert key in data["machine"]
    assert data["copy_bandwidth"]["bandwidth_gbs"] > 0
    markdown = (smoke / "smoke-cpu.md").read_text()
    for heading in ("## 1.", "## 2.", "## 3-4.", "## 5. Goals", "DynamicCache"):
        assert heading in markdown


def test_smoke_rows(smoke):
    data = json.loads((smoke / "smoke-cpu.json").read_text())
    attention = data["attention"]
    assert {r["executor"] for r in attention} == {"dense_sdpa", "sdpa"}
    for row in attention:
        assert {"median", "min", "max", "reps"} <= set(row["timing"])
        assert row["speedup_vs_dense"] > 0
        if row["executor"] != "dense_sdpa":
            assert row["max_abs_err_vs_reference"] < 1e-4
            assert row["kv_sparsity_reported"] == pytest.approx(row["rho_kv"])
    assert {"fraction_stored", "fraction_current", "criterion"} <= set(data["overhead"][0])
    e2e = {r["config"]: r for r in data["end_to_end"]}
    assert set(e2e) == {"dense", "dense dynamic cache", "qada dense", "qada", "static rho_kv=0.5",
                        "static rho_kv=0.875"}
    assert e2e["dense"]["token_agreement"] == 1.0 and e2e["dense"]["speedup_vs_dense"] == pytest.approx(1.0)
    assert e2e["dense"]["cache"] == "static" and e2e["dense dynamic cache"]["cache"] == "dynamic"
    # the same greedy tokens whatever the cache, and with qada's wrapper around the dense criterion
    assert e2e["dense dynamic cache"]["token_agreement"] == 1.0 and e2e["qada dense"]["token_agreement"] == 1.0
    assert e2e["static rho_kv=0.5"]["kv_sparsity"] == pytest.approx(0.5)
    for row in e2e.values():
        assert {"tokens_per_s_median", "sparsity", "kv_sparsity", "first_step_max_abs_logit_diff", "first_step_s",
                "t_min_s", "ceiling_fraction", "weight_bytes", "kv_bytes"} <= set(row)
        assert 0 < row["ceiling_fraction"]
    dense, static = e2e["dense"], e2e["static rho_kv=0.875"]
    assert static["kv_bytes"] < dense["kv_bytes"] and static["weight_bytes"] == dense["weight_bytes"]
    assert {g["status"] for g in data["goals"]} <= {"pass", "miss", "not measured"}


def test_static_group_mask_fraction():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.end_to_end import group_static_mask
    finally:
        sys.path.remove(str(ROOT))
    mask = group_static_mask(30, 9, 3, 0.875)
    groups = mask.view(30, 3, 3)
    assert (groups.all(-1) | ~groups.any(-1)).all()  # whole groups only
    assert groups.all(-1).float().mean().item() == pytest.approx(79 / 90)


def test_gpu_suite_dry_run_covers_every_gpu_case(tmp_path):
    """``--gpu --dry-run``: the GPU suite's code on the CPU (Triton in the interpreter), tiny shapes."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.run import main
    finally:
        sys.path.remove(str(ROOT))
    main(["--gpu", "--dry-run", "--out", str(tmp_path), "--quiet"])
    data = json.loads((tmp_path / "gpu-dryrun-cpu.json").read_text())
    assert data["errors"] == []
    assert {r["executor"] for r in data["attention"]} >= {"dense_sdpa", "sdpa", "flex", "triton"}
    e2e = {r["config"]: r for r in data["end_to_end"]}
    assert {"dense", "dense dynamic cache", "qada dense", "qada", "static rho_kv=0.875"} <= set(e2e)
    assert e2e["qada"]["cache"] == "static"
