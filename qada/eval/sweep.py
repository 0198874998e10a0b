"""A paper-style sweep over tasks and lengths: calibrate static masks, evaluate every configuration, report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qada.eval.calibrate import calibrate_static, save_static_frequency
from qada.eval.configs import EvalConfig, sweep_configs
from qada.eval.evaluator import Evaluator
from qada.eval.report import result_record
from qada.eval.tasks import TASKS, Sample

__all__ = ["STATIC_FAMILIES", "run_sweep"]

#: The static head-mask families a sweep can calibrate: on the evaluated samples, or on the other tasks' samples.
STATIC_FAMILIES = ("static_oracle", "static_ruler")


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
) -> list[dict]:
    """Evaluate dense, oracle, QAdA (per moment source) and static masks on each (task, length).

    ``static_oracle`` is calibrated on the evaluated samples themselves, ``static_ruler`` on samples of the
    other tasks of the sweep at the same length (different seed); with a single task ``static_ruler`` is skipped.
    Results (per-sample JSONL for resume, calibration artifacts) go under ``out_dir/<task>-<length>/``.
    """
    from qada.eval.validate import check_count, check_length_fits, check_output_dir

    check_count(num_samples, "num_samples")
    if calibration_samples is not None:
        check_count(calibration_samples, "calibration_samples")
    if not tasks or not lengths:
        raise ValueError(f"expected at least one task and one length but got tasks={list(tasks)}, "
                         f"lengths={list(lengths)}")
    unknown = sorted(set(static) - set(STATIC_FAMILIES))
    if unknown:
        raise ValueError(f"unknown static famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; expected some of "
                         f"{list(STATIC_FAMILIES)}")
    for task in tasks:
        TASKS.get(task)  # an unknown task fails before any work
    for config in sweep_configs(list(taus) if taus is not None else [0.5], tuple(moment_sources)):
        config.build()  # bad tau or moment-source parameters fail before any calibration
    for length in lengths:
        check_count(length, "a length")
        check_length_fits(length, model, "length")
    out = check_output_dir(out_dir)
    records: list[dict] = []
    for length in lengths:
        generated: dict[str, list[Sample]] = {
            task: TASKS.build(task, template=template).generate(tokenizer, length, num_samples, seed)
            for task in tasks
        }
        for task in tasks:
            folder = out / f"{task}-{length}"
            masks = {}
            if "static_oracle" in static:
                masks["static_oracle"] = _calibrated(
                    model, tokenizer, generated[task], folder / "static_oracle.safetensors", tau_static, progress
                )
            others = [t for t in tasks if t != task]
            if "static_ruler" in static and others:
                n = calibration_samples or num_samples
                pool = [s for t in others
                        for s in TASKS.build(t, template=template).generate(tokenizer, length, n, seed + 1)]
                masks["static_ruler"] = _calibrated(model, tokenizer, pool, folder / "static_ruler.safetensors",
                                                    tau_static, progress)
            configs: list[EvalConfig] = sweep_configs(
                list(taus) if taus is not None else None, tuple(moment_sources), static_masks=masks,
                alphas=list(alphas) if alphas is not None else None,
            )
            settings = {"seed": seed, "template": template, "data": {"task": task, "length": length},
                        "tau_static": tau_static}
            evaluator = Evaluator(model, tokenizer, configs, folder, fabric=fabric, record_oracle=record_oracle,
                                  progress=progress, settings=settings)
            results = evaluator.evaluate(generated[task])
            records += [result_record(entry, task, length, len(generated[task]), model, seed, {"template": template})
                        for entry in results.values()]
    return records


def _calibrated(model, tokenizer, samples, path: Path, tau_static: float, progress: bool):
    """Calibrate (or reuse a finished calibration at ``path``) and return the ``[L, H]`` frequencies."""
    from qada.eval.calibrate import load_static_frequency

    if path.is_file():
        return load_static_frequency(path, model)[0]
    frequency = calibrate_static(model, tokenizer, samples, tau_static, decode_with_oracle=True, progress=progress)
    save_static_frequency(path, frequency, model, alpha=0.5, info={"tau_static": tau_static, "n": len(samples)})
    return frequency
