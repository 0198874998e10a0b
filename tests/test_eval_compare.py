"""The comparison report (mean score over a sparsity interval, who dominates where) and the sweep's new inputs:
``--data`` files, ``--criterion``, ``--static-from``, ``--no-oracle``/``--no-qada``, ``fitted_on``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from qada.cli import main
from qada.eval.compare import (
    comparison,
    comparison_markdown,
    curve_points,
    dominance,
    interpolate,
    mean_score,
    place_labels,
    point_tag,
    sparsity_grid,
)

# --- pure functions -----------------------------------------------------------------------------------------


def test_mean_score_of_a_constant_is_the_constant():
    result = mean_score([(0.5, 70.0), (0.8, 70.0), (1.0, 70.0)])
    assert result["mean_score"] == pytest.approx(70.0)
    assert result["coverage"] == pytest.approx(1.0) and result["reason"] is None


def test_mean_score_of_a_line_is_its_midpoint_value():
    line = [(x / 10, 100 * x / 10) for x in range(11)]  # score = 100 * sparsity
    assert mean_score(line, 0.7, 0.95)["mean_score"] == pytest.approx(82.5)
    # points inside the interval (kinks) and unsorted input give the same answer for a line
    assert mean_score([(0.9, 90.0), (0.6, 60.0), (0.75, 75.0), (1.0, 100.0)])["mean_score"] == pytest.approx(82.5)


def test_mean_score_of_a_kinked_curve_is_the_trapezoid_area():
    # 100 up to 0.8, then down to 50 at 0.95: area 0.1*100 + 0.15*75 = 21.25 over width 0.25
    assert mean_score([(0.0, 100.0), (0.8, 100.0), (0.95, 50.0)])["mean_score"] == pytest.approx(85.0)


def test_mean_score_is_none_unless_the_points_span_the_interval():
    short = mean_score([(0.5, 80.0), (0.9, 60.0)])
    assert short["mean_score"] is None
    assert short["coverage"] == pytest.approx(0.8) and short["covered"] == [0.7, 0.9]
    assert "80% of [0.7, 0.95]" in short["reason"]
    late = mean_score([(0.75, 80.0), (0.99, 60.0)])
    assert late["mean_score"] is None and late["coverage"] == pytest.approx(0.8)
    outside = mean_score([(0.0, 100.0)])
    assert outside["mean_score"] is None and outside["coverage"] == 0.0 and outside["covered"] is None
    assert mean_score([])["reason"] == "no measured points"
    with pytest.raises(ValueError, match="lo < hi"):
        mean_score([(0.8, 1.0)], 0.9, 0.7)


def test_points_at_the_same_sparsity_are_averaged_and_interpolation_does_not_extrapolate():
    assert curve_points([(0.8, 40.0), (0.5, 10.0), (0.8, 60.0), (None, 1.0)]) == [(0.5, 10.0), (0.8, 50.0)]
    points = curve_points([(0.5, 10.0), (0.8, 40.0)])
    assert interpolate(points, 0.6) == pytest.approx(20.0)
    assert interpolate(points, 0.4) is None and interpolate(points, 0.9) is None
    assert interpolate([(0.7, 5.0)], 0.7) == 5.0


def test_the_grid_and_who_dominates_with_ties():
    grid = sparsity_grid()
    assert grid == [0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    curves = {
        "qada": [(0.6, 90.0), (1.0, 50.0)],      # 90 - 100 (x - 0.6): 80 at 0.7, 55 at 0.95
        "static": [(0.7, 80.0), (0.95, 80.0)],   # flat 80: ties qada at 0.7
        "oracle": [(0.85, 100.0), (0.9, 100.0)],  # only competes where it has points
        "dense": [(0.0, 100.0)],
    }
    rows = {row["sparsity"]: row for row in dominance(curves, grid)}
    assert rows[0.7]["best"] == ["qada", "static"] and rows[0.7]["score"] == pytest.approx(80.0)
    assert rows[0.75]["best"] == ["static"]
    assert rows[0.85]["best"] == ["oracle"] and set(rows[0.85]["competing"]) == {"qada", "static", "oracle"}
    assert rows[0.95]["best"] == ["static"]
    assert dominance({"dense": [(0.0, 100.0)]}, [0.8]) == [
        {"sparsity": 0.8, "best": [], "score": None, "competing": {}}]


def test_point_tags_and_label_placement_keep_overlapping_points_apart():
    assert point_tag({"label": "qada/stored tau=0.6", "family": "qada/stored"}) == "τ0.6"
    assert point_tag({"label": "static:cal alpha=0.5", "family": "static:cal"}) == "α0.5"
    assert point_tag({"label": "qada_budget sparsity=0.85", "family": "qada_budget"}) == "sparsity=0.85"
    assert point_tag({"label": "dense", "family": "dense"}) == ""
    offsets = place_labels([(100.0, 100.0)] * 3, [(20.0, 6.0)] * 3)
    assert len(set(offsets)) == 3, "labels of points at the same place go to different sides"
    far = place_labels([(0.0, 0.0), (500.0, 500.0)], [(20.0, 6.0)] * 2)
    assert far[0] == far[1], "labels far apart keep the first choice"
    [edge] = place_labels([(98.0, 50.0)], [(20.0, 6.0)], bounds=(0.0, 0.0, 100.0, 100.0))
    assert edge[0] < 0, "a label at the right edge goes to the left of its point"


def _record(task, family, label, sparsity, score, kv=None, **extra):
    return {"task": task, "length": 2048, "n": 5, "label": label, "family": family, "score": score,
            "sparsity": sparsity, "kv_sparsity": kv if kv is not None else sparsity / 2, **extra}


RECORDS = [
    _record("niah_single_1", "dense", "dense", 0.0, 100.0),
    *[_record("niah_single_1", "qada/stored", f"qada/stored tau={t}", s, sc)
      for t, s, sc in ((0.3, 0.6, 100.0), (0.6, 0.8, 90.0), (0.9, 0.97, 40.0), (0.95, 0.97, 30.0))],
    *[_record("niah_single_1", "static:cal", f"static:cal alpha={a}", a, sc,
              fitted_on=[{"file": "cal.safetensors", "kind": "head_mask",
                          "info": {"tasks": ["vt", "qa_1"], "seed": 3, "n": 20, "tau_static": 0.6}}])
      for a, sc in ((0.75, 90.0), (0.85, 80.0), (0.95, 10.0))],
    _record("niah_single_1", "qada_budget", "qada_budget sparsity=0.85", 0.85, 85.0),
    _record("vt", "dense", "dense", 0.0, 60.0),
    _record("vt", "qada/stored", "qada/stored tau=0.6", 0.8, 50.0),
]


def test_comparison_tables():
    rows = comparison(RECORDS)
    assert [(r["task"], r["length"]) for r in rows] == [("niah_single_1", 2048), ("vt", 2048)]
    families = rows[0]["families"]
    assert families["qada/stored"]["mean_score"] is not None and families["qada/stored"]["points"] == 4
    assert families["static:cal"]["mean_score"] is None and families["static:cal"]["coverage"] == pytest.approx(0.8)
    assert families["dense"]["mean_score"] is None
    text = comparison_markdown(rows)
    assert "| niah_single_1 | 2048 | static:cal | 3 | - | 80% |" in text
    assert "### Who dominates where" in text and "| task | length | 0.7 | 0.75 |" in text


def test_comparison_over_kv_read_ranks_by_what_a_step_reads():
    records = [{**_record("niah_single_1", family, f"{family} tau={t}", sparsity, score), "kv_read": read}
               for family, t, sparsity, score, read in (
                   ("qada_tail/stored", 0.3, 0.9, 100.0, 0.45), ("qada_tail/stored", 0.6, 0.8, 100.0, 0.6),
                   ("qada/stored", 0.3, 0.85, 90.0, 0.2), ("qada/stored", 0.6, 0.7, 100.0, 0.35),
                   ("qada/stored", 0.9, 0.4, 80.0, 0.65))]
    rows = comparison(records, 0.1, 0.5, axis="kv_read")
    assert rows[0]["axis"] == "kv_read"
    families = rows[0]["families"]
    # plain QAdA spans [0.2, 0.65] (but not 0.1: no area); the tail family only [0.45, 0.6]
    assert families["qada/stored"]["mean_score"] is None and "kv_read" in families["qada/stored"]["reason"]
    best = {d["sparsity"]: d["best"] for d in rows[0]["dominance"]}
    assert best[0.3] == ["qada/stored"] and best[0.5] == ["qada_tail/stored"] and best[0.1] == []
    text = comparison_markdown(rows)
    assert "### Mean score over kv_read [0.1, 0.5]" in text and "### Who dominates where (kv_read)" in text


def test_analyze_compare_writes_the_plot_and_the_markdown(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text(json.dumps(RECORDS))
    extra = tmp_path / "more.json"  # a second sweep's results: merged, later files win on equal labels
    extra.write_text(json.dumps([_record("vt", "qada/stored", "qada/stored tau=0.9", 0.96, 20.0),
                                 _record("vt", "qada/stored", "qada/stored tau=0.3", 0.5, 60.0)]))
    out = tmp_path / "cmp"
    assert main(["analyze", "--compare", str(results), "--compare", str(extra), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "niah_single_1 @ 2048: mean score over sparsity [0.7, 0.95]: qada/stored" in printed
    assert "niah_single_1 @ 2048: mean score over kv_read [0.1, 0.5]:" in printed
    md = (out / "comparison.md").read_text()
    assert "Produced by `qada analyze --compare" in md and "### Mean score over kv_read [0.1, 0.5]" in md
    assert "### What the calibration artifacts were fitted on" in md
    assert "cal.safetensors (head_mask) | n=20; seed=3; tasks=vt,qa_1; tau_static=0.6" in md
    rows = json.loads((out / "comparison.json").read_text())
    vt = next(r for r in rows if r["task"] == "vt")
    assert vt["families"]["qada/stored"]["points"] == 3 and vt["families"]["qada/stored"]["mean_score"] is not None
    assert (out / "comparison.png").stat().st_size > 10_000

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "records"}))
    assert main(["analyze", "--compare", str(bad), "--out", str(out)]) == 2
    assert "expected a sweep's results.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["analyze", "--compare", str(results), "--auc-range", "0.9,0.7", "--out", str(out)])


# --- the sweep ----------------------------------------------------------------------------------------------


def _calibration_file(tmp_path, model_dir):
    from transformers import AutoConfig

    from qada.eval.calibrate import save_static_frequency

    config = AutoConfig.from_pretrained(model_dir)
    frequency = torch.linspace(0, 1, config.num_hidden_layers * config.num_attention_heads).reshape(
        config.num_hidden_layers, config.num_attention_heads)
    return save_static_frequency(tmp_path / "cal.safetensors", frequency, SimpleNamespace(config=config), alpha=0.5,
                                 info={"tasks": ["vt"], "seed": 7, "n": 3, "tau_static": 0.6})


def test_sweep_on_data_files_with_extra_criteria_and_a_static_calibration_from_elsewhere(tiny_model_dir, tmp_path,
                                                                                        capsys):
    from qada.eval.identity import file_digest
    from qada.eval.tasks import TASKS, save_ruler_jsonl

    path, tokenizer = tiny_model_dir
    data = tmp_path / "ruler" / "niah.jsonl"
    data.parent.mkdir()
    save_ruler_jsonl(TASKS.build("niah_single_2").generate(tokenizer, 200, 1, seed=0), data)
    calibration = _calibration_file(tmp_path, path)
    out = tmp_path / "sweep"
    argv = ["sweep", "--data", str(data), "--samples", "1", "--alphas", "0.5", "--static", "static_oracle",
            "--static-from", str(calibration), "--no-oracle", "--no-qada",
            "--criterion", "{name: qada, tau: 0.45}", "--criterion-moments", "current", "--criterion", "local",
            "--model", str(path), "--out", str(out)]
    assert main(argv) == 0
    records = json.loads((out / "results.json").read_text())
    assert {r["label"]: r["family"] for r in records} == {
        "dense": "dense", "static_oracle alpha=0.5": "static_oracle", "static:cal alpha=0.5": "static:cal",
        "qada/current tau=0.45": "qada/current", "local": "local"}
    assert {(r["task"], r["length"]) for r in records} == {("niah_single_2", records[0]["length"])}
    assert 150 <= records[0]["length"] <= 210
    by = {r["label"]: r for r in records}
    assert by["dense"]["data"]["digest"] == file_digest(data)
    from_file = by["static:cal alpha=0.5"]["fitted_on"]
    assert from_file[0]["info"] == {"tasks": ["vt"], "seed": 7, "n": 3, "tau_static": 0.6}
    calibrated = by["static_oracle alpha=0.5"]["fitted_on"][0]["info"]
    assert calibrated["tasks"] == ["niah_single_2"] and calibrated["n"] == 1
    assert calibrated["digest"] == file_digest(data)
    assert "fitted_on" not in by["dense"] and "fitted_on" not in by["local"]
    identity = json.loads(next((out / "niah").glob("identities-rank*.json")).read_text())
    assert any(v.get("settings", {}).get("data", {}).get("digest") == file_digest(data) for v in identity.values())
    md = (out / "results.md").read_text()
    assert "What the calibration artifacts were fitted on" in md and str(calibration) in md
    assert (out / "comparison.md").is_file() and (out / "comparison.png").is_file()

    # --report-only rebuilds the same families, cell and fitted_on from the rows and cell.json
    capsys.readouterr()
    assert main(["sweep", "--report-only", "--out", str(out)]) == 0
    rebuilt = {r["label"]: r for r in json.loads((out / "results.json").read_text())}
    assert {k: (v["task"], v["length"], v["family"]) for k, v in rebuilt.items()} == {
        k: (v["task"], v["length"], v["family"]) for k, v in by.items()}
    assert rebuilt["static:cal alpha=0.5"]["fitted_on"] == from_file

    # a rerun resumes: nothing is decoded again
    rows = (out / "niah" / "results-rank0.jsonl").read_text()
    assert main(argv) == 0
    assert (out / "niah" / "results-rank0.jsonl").read_text() == rows


def test_run_sweep_on_ruler_layout_files_calibrates_static_ruler_on_the_other_files(tiny_model_dir, tmp_path):
    from qada.eval.sweep import run_sweep
    from qada.eval.tasks import TASKS, save_ruler_jsonl
    from qada.models import load_model

    path, tokenizer = tiny_model_dir
    files = []
    for task in ("niah_single_2", "niah_single_1"):  # RULER's {task}/validation.jsonl: same stems, other folders
        (tmp_path / task).mkdir()
        files.append(tmp_path / task / "validation.jsonl")
        save_ruler_jsonl(TASKS.build(task).generate(tokenizer, 200, 1, seed=0), files[-1])
    model, tokenizer = load_model(str(path))
    records = run_sweep(model, tokenizer, [], [], 1, tmp_path / "out", alphas=[0.5], moment_sources=(),
                        static=("static_ruler",), include_oracle=False, data_files=files, progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["niah_single_1-validation",
                                                                    "niah_single_2-validation"]
    ruler = {r["task"]: r for r in records if r["family"] == "static_ruler"}
    assert set(ruler) == {"niah_single_2", "niah_single_1"}
    assert ruler["niah_single_1"]["fitted_on"][0]["info"]["tasks"] == ["niah_single_2"]
    assert ruler["niah_single_2"]["fitted_on"][0]["info"]["data"][0]["file"] == "validation.jsonl"
    with pytest.raises(ValueError, match="expected at least one task and one length"):
        run_sweep(model, tokenizer, ["vt"], [], 1, tmp_path / "o2", data_files=files)
    with pytest.raises(ValueError, match=r"share the \(task, length\)"):
        run_sweep(model, tokenizer, [], [], 1, tmp_path / "o3", data_files=[files[0], files[0]], static=(),
                  moment_sources=(), include_oracle=False)


@pytest.mark.parametrize("extra, message", [
    (["--criterion", "{name: oracle, tau: 0.3}"], "already part of the sweep"),
    (["--criterion", "local", "--criterion", "local"], "given twice"),
    (["--criterion", "{name: nope}"], "nope"),
])
def test_sweep_refuses_bad_extra_criteria_before_the_model_loads(tmp_path, capsys, extra, message):
    assert main(["sweep", "--taus", "0.3", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"),
                 *extra]) == 2
    assert message in capsys.readouterr().err


def test_sweep_static_from_must_be_a_calibration(tmp_path, capsys, tiny_model_dir):
    from transformers import AutoConfig

    from qada.artifacts import model_fingerprint, save_head_mask

    config = AutoConfig.from_pretrained(tiny_model_dir[0])
    mask = save_head_mask(tmp_path / "mask.safetensors", torch.zeros(2, 4, dtype=torch.bool), model_fingerprint(config))
    assert main(["sweep", "--static-from", str(mask), "--model", "x", "--out", str(tmp_path / "o")]) == 2
    assert "expected a static calibration from `qada calibrate`" in capsys.readouterr().err


def test_sweep_data_alone_generates_no_tasks_and_flags_combine():
    from qada.cli import build_parser
    from qada.cli.sweep import cells

    parser = build_parser()
    assert cells(parser.parse_args(["sweep", "--out", "o"])) == (["niah_single_1", "niah_single_2"], [2048])
    args = parser.parse_args(["sweep", "--out", "o", "--data", __file__])
    assert cells(args) == ([], [])
    args = parser.parse_args(["sweep", "--out", "o", "--data", __file__, "--tasks", "vt"])
    assert cells(args) == (["vt"], [2048])
