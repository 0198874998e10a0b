"""A paper-style sweep over tasks and lengths: calibrate static masks, evaluate every configuration, report."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qada.eval.calibrate import calibrate_static, save_static_frequency
from qada.eval.configs import EvalConfig, sweep_configs
from qada.eval.evaluator import Evaluator
from qada.eval.identity import artifact_digests, file_digest, plain
from qada.eval.report import result_record
from qada.eval.results_file import write_json
from qada.eval.tasks import TASKS, Sample

__all__ = ["STATIC_FAMILIES", "artifact_provenance", "check_extra_labels", "run_sweep"]

#: The static head-mask families a sweep can calibrate: on the evaluated samples, or on the other tasks' samples.
STATIC_FAMILIES = ("static_oracle", "static_ruler")


@dataclass
class _Cell:
    """One (task, length) of a sweep: its samples, folder, what its data is, and its static calibration pool."""

    task: str
    length: int
    samples: list[Sample]
    folder: Path
    data: dict[str, Any]
    ruler_pool: Callable[[], list[Sample]] | None = None
    ruler_info: dict[str, Any] = field(default_factory=dict)


def run_sweep(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    lengths: Sequence[int],
    num_samples: int,
    out_dir: str | Path,
    taus: Sequence[float] | None = None,
    alphas: Sequence[float] | None = None,
    moment_sources: Sequence[str] = ("stored", "current"),
    static: Sequence[str] = ("static_oracle", "static_ruler"),
    calibration_samples: int | None = None,
    tau_static: float = 0.6,
    record_oracle: bool = False,
    seed: int = 0,
    template: str = "base",
    fabric: Any = None,
    progress: bool = True,
    data_files: Sequence[str | Path] = (),
    criteria: Sequence[EvalConfig] = (),
    static_from: Sequence[str | Path] = (),
    include_oracle: bool = True,
) -> list[dict]:
    """Evaluate dense, oracle, QAdA (per moment source) and static masks on each (task, length).

    ``static_oracle`` is calibrated on the evaluated samples themselves, ``static_ruler`` on samples of the
    other tasks of the sweep at the same length (different seed); with a single task ``static_ruler`` is skipped.
    Results (per-sample JSONL for resume, calibration artifacts) go under ``out_dir/<task>-<length>/``.

    Args:
        data_files: RULER jsonl files (:func:`qada.eval.tasks.load_ruler_jsonl`), each one more cell besides the
            generated ``tasks`` x ``lengths`` (which may then be empty): its task is the rows' ``task`` (else
            the folder's name), its length the mean prompt length in tokens, its first ``num_samples`` rows are
            evaluated, its results go under ``out_dir/<file stem>/`` and the file's digest is part of the run
            identity. ``static_ruler`` of a file's cell is calibrated on the other files' samples.
        criteria: more configurations (e.g. from :func:`qada.cli.common.build_eval_config`) evaluated in every
            cell; their labels must be unique.
        static_from: static calibration artifacts made elsewhere (``qada calibrate``, loaded with
            :func:`qada.eval.calibrate.load_static_frequency` and checked against ``model``), each its own
            family ``static:<file stem>`` swept over ``alphas``.
        include_oracle: evaluate the oracle curve (``moment_sources=()`` leaves out the QAdA curves).

    Every record of a configuration that uses a calibration artifact carries ``fitted_on``: the file and the
    information saved in it (tasks, length, seed, number of prompts, ``tau_static``).
    """
    from qada.eval.validate import check_count, check_length_fits, check_output_dir

    check_count(num_samples, "num_samples")
    if calibration_samples is not None:
        check_count(calibration_samples, "calibration_samples")
    tasks, lengths, data_files = list(tasks), list(lengths), [Path(p) for p in data_files]
    if (not tasks or not lengths) and not (data_files and not tasks and not lengths):
        raise ValueError(f"expected at least one task and one length (or data files alone) but got "
                         f"tasks={tasks}, lengths={lengths}")
    unknown = sorted(set(static) - set(STATIC_FAMILIES))
    if unknown:
        raise ValueError(f"unknown static famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; expected some of "
                         f"{list(STATIC_FAMILIES)}")
    for task in tasks:
        TASKS.get(task)  # an unknown task fails before any work
    builtin = sweep_configs(list(taus) if taus is not None else [0.5], tuple(moment_sources),
                            include_oracle=include_oracle)
    for config in [*builtin, *criteria]:
        config.build()  # bad tau, moment-source or criterion parameters fail before any calibration
    check_extra_labels(criteria, taus, moment_sources, include_oracle)
    for length in lengths:
        check_count(length, "a length")
        check_length_fits(length, model, "length")
    loaded = _load_static_from(static_from, model)  # family -> (frequency, fitted_on); checked against the model
    extra_fitted = {c.label: artifact_provenance([c.criterion, c.moments]) for c in criteria}
    out = check_output_dir(out_dir)
    cells = _generated_cells(tokenizer, tasks, lengths, num_samples, seed, template, calibration_samples, out)
    cells += _data_cells(model, tokenizer, data_files, num_samples, calibration_samples, out)
    _check_unique_cells(cells)
    rank0 = fabric is None or getattr(fabric, "global_rank", 0) == 0
    records: list[dict] = []
    for cell in cells:
        masks: dict[str, Any] = {}
        fitted: dict[str, list[dict]] = {}
        if "static_oracle" in static:
            path = cell.folder / "static_oracle.safetensors"
            info = {"samples": "the evaluated samples", "tasks": [cell.task], "length": cell.length, **cell.data}
            masks["static_oracle"] = _calibrated(model, tokenizer, cell.samples, path, tau_static, progress, info)
            fitted["static_oracle"] = [_provenance(path, drop=("alpha",))]
        if "static_ruler" in static and cell.ruler_pool is not None:
            path = cell.folder / "static_ruler.safetensors"
            pool = None if path.is_file() else cell.ruler_pool()
            masks["static_ruler"] = _calibrated(model, tokenizer, pool, path, tau_static, progress, cell.ruler_info)
            fitted["static_ruler"] = [_provenance(path, drop=("alpha",))]
        for family, (frequency, provenance) in loaded.items():
            masks[family] = frequency
            fitted[family] = [provenance]
        configs: list[EvalConfig] = sweep_configs(
            list(taus) if taus is not None else None, tuple(moment_sources), static_masks=masks,
            alphas=list(alphas) if alphas is not None else None, include_oracle=include_oracle,
        ) + list(criteria)
        by_label = {c.label: fitted.get(c.family) or extra_fitted.get(c.label) or [] for c in configs}
        if rank0:  # what --report-only needs beyond the rows: the cell, every label's family and fitted_on
            write_json(cell.folder / "cell.json", {
                "task": cell.task, "length": cell.length, "data": cell.data,
                "configs": {c.label: {"family": c.family, **({"fitted_on": by_label[c.label]}
                                                             if by_label[c.label] else {})} for c in configs}})
        settings = {"seed": seed, "template": template, "data": cell.data, "tau_static": tau_static}
        evaluator = Evaluator(model, tokenizer, configs, cell.folder, fabric=fabric, record_oracle=record_oracle,
                              progress=progress, settings=settings)
        results = evaluator.evaluate(cell.samples)
        for entry in results.values():
            extra = {"template": template, **({"data": cell.data} if "file" in cell.data else {})}
            if by_label[entry["label"]]:
                extra["fitted_on"] = by_label[entry["label"]]
            records.append(result_record(entry, cell.task, cell.length, len(cell.samples), model, seed, extra))
    return records


def check_extra_labels(criteria: Sequence[EvalConfig], taus: Sequence[float] | None = None,
                       moment_sources: Sequence[str] = ("stored", "current"), include_oracle: bool = True) -> None:
    """Extra configurations need labels unique among themselves and the sweep's own (``ValueError`` otherwise)."""
    own = {c.label for c in sweep_configs(list(taus) if taus is not None else None, tuple(moment_sources),
                                          include_oracle=include_oracle)}
    seen: set[str] = set()
    for config in criteria:
        if config.label in own:
            raise ValueError(f"criterion {config.label!r} is already part of the sweep (its oracle/QAdA curves); "
                             "leave it out or change a parameter")
        if config.label in seen:
            raise ValueError(f"criterion {config.label!r} is given twice; every configuration needs its own label")
        seen.add(config.label)


def artifact_provenance(specs: Any) -> list[dict]:
    """``fitted_on`` entries for the qada artifacts a (nested) spec names: ``{"file", "kind", "info"}`` each."""
    from qada.artifacts import ArtifactError

    out = []
    for path in artifact_digests(plain(specs)):
        try:
            out.append(_provenance(Path(path)))
        except ArtifactError:
            continue  # a file that is not a qada artifact (a YAML spec...): nothing was fitted
    return out


def _provenance(path: Path, drop: Sequence[str] = ()) -> dict:
    """The artifact's file, kind and saved information (what it was fitted on), less the ``drop`` keys."""
    from qada.artifacts import read_artifact_info

    info = read_artifact_info(path)
    return {"file": str(path), "kind": info.kind, "digest": file_digest(path),
            "info": {k: v for k, v in info.info.items() if k not in drop}}


def _load_static_from(paths: Sequence[str | Path], model: Any) -> dict[str, tuple[Any, dict]]:
    """``static:<stem>`` -> (``[L, H]`` frequencies, provenance) of each file, checked against the model."""
    from qada.eval.calibrate import load_static_frequency

    loaded: dict[str, tuple[Any, dict]] = {}
    for path in map(Path, paths):
        family = f"static:{path.stem}"
        if family in loaded:
            raise ValueError(f"two static calibration files are named {path.stem!r}; rename one (the family "
                             f"{family!r} must be unique)")
        frequency = load_static_frequency(path, model)[0]  # kind, tensors and the model fingerprint checked
        loaded[family] = (frequency, _provenance(path, drop=("alpha",)))
    return loaded


def _generated_cells(tokenizer, tasks, lengths, num_samples, seed, template, calibration_samples, out) -> list[_Cell]:
    cells = []
    for length in lengths:
        generated: dict[str, list[Sample]] = {
            task: TASKS.build(task, template=template).generate(tokenizer, length, num_samples, seed)
            for task in tasks
        }
        for task in tasks:
            others = [t for t in tasks if t != task]
            n = calibration_samples or num_samples

            def pool(others=others, length=length, n=n) -> list[Sample]:
                return [s for t in others
                        for s in TASKS.build(t, template=template).generate(tokenizer, length, n, seed + 1)]

            cells.append(_Cell(
                task, length, generated[task], out / f"{task}-{length}", {"task": task, "length": length},
                pool if others else None,
                {"samples": "other tasks' prompts", "tasks": others, "length": length, "seed": seed + 1, "n": n,
                 "template": template}))
    return cells


def _data_cells(model, tokenizer, paths: Sequence[Path], num_samples, calibration_samples, out) -> list[_Cell]:
    """One cell per RULER jsonl (rows checked, prompts against the model's positions) before any work."""
    from qada.eval.tasks import load_ruler_jsonl
    from qada.eval.validate import check_length_fits

    loaded = [load_ruler_jsonl(p, tokenizer=tokenizer)[:num_samples] for p in paths]
    stems = [p.stem for p in paths]
    names = [p.stem if stems.count(p.stem) == 1 else f"{p.parent.name}-{p.stem}" for p in paths]
    cells = []
    for index, (path, samples, name) in enumerate(zip(paths, loaded, names, strict=True)):
        tasks = sorted({s.task for s in samples})
        task = tasks[0] if len(tasks) == 1 else path.stem
        longest = max(s.length for s in samples)
        check_length_fits(longest, model, f"data file {str(path)!r}: a prompt of")
        length = round(sum(s.length for s in samples) / len(samples))
        data = {"file": path.name, "digest": file_digest(path), "tokens": [min(s.length for s in samples), longest]}
        others = [(p, s) for i, (p, s) in enumerate(zip(paths, loaded, strict=True)) if i != index]
        n = calibration_samples or num_samples
        ruler_info = {"samples": "the other data files' prompts", "n": sum(min(n, len(s)) for _, s in others),
                      "data": [{"file": p.name, "digest": file_digest(p)} for p, _ in others],
                      "tasks": sorted({x.task for _, s in others for x in s})}
        pool = (lambda others=others, n=n: [x for _, s in others for x in s[:n]]) if others else None
        cells.append(_Cell(task, length, samples, out / name, data, pool, ruler_info))
    return cells


def _check_unique_cells(cells: Sequence[_Cell]) -> None:
    seen: dict[Any, _Cell] = {}
    for cell in cells:
        for key in ((cell.task, cell.length), cell.folder):
            if key in seen:
                what = "the folder" if isinstance(key, Path) else "the (task, length)"
                raise ValueError(f"two cells of the sweep would share {what} {key}: {seen[key].data} and "
                                 f"{cell.data}; sweep them apart")
            seen[key] = cell


def _calibrated(model, tokenizer, samples, path: Path, tau_static: float, progress: bool, info: dict | None = None):
    """Calibrate (or reuse a finished calibration at ``path``) and return the ``[L, H]`` frequencies.

    ``info`` (what the calibration prompts were) is saved in the artifact, with ``tau_static`` and ``n``.
    """
    from qada.eval.calibrate import load_static_frequency

    if path.is_file():
        return load_static_frequency(path, model)[0]
    frequency = calibrate_static(model, tokenizer, samples, tau_static, decode_with_oracle=True, progress=progress)
    save_static_frequency(path, frequency, model, alpha=0.5,
                          info={**(info or {}), "tau_static": tau_static, "n": len(samples)})
    return frequency
