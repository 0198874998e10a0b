"""qada's speed benchmarks (issue 8): one command per suite.

    python benchmarks/run.py --quick              # CPU, ~5-8 min: attention, overhead, end-to-end at 4k and 7.68k
    python benchmarks/run.py                      # the full CPU suite (run it on a quiet machine)
    python benchmarks/run.py --gpu --out $OUT     # the GPU suite (H100/H200; SmolLM2 and Llama-3-8B shapes, bf16,
                                                  # and every layer's decisions against the CPU's: --only parity)
    python benchmarks/run.py --gpu --dry-run      # the GPU code path on the CPU with tiny shapes
    python benchmarks/run.py --smoke              # tiny shapes, 1 repetition (the test)

Results: ``<out>/<suite>-<machine>.json`` and ``.md`` (default out: benchmarks/results), rewritten after every
section (and end-to-end model) so that an interrupted run keeps what it measured. ``--only`` and ``--models`` pick
sections and end-to-end models (a GPU command may run 10 minutes: one call per section or model).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``python benchmarks/run.py`` from anywhere
    sys.path.insert(0, str(ROOT))


SECTIONS = ("attention", "bandwidth", "overhead", "end_to_end", "parity")
"""What ``--only`` may name (``bandwidth``: the part of ``attention`` that issue 33's dense-at-bandwidth goal reads;
``parity``: a GPU suite's, the device's decisions against the CPU's)."""

DEFAULT_SECTIONS = ("attention", "overhead", "end_to_end")
"""What a suite runs without ``--only``; a suite with parity cases (the GPU suites) also runs ``parity``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="qada speed benchmarks", formatter_class=argparse.RawTextHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short CPU suite (~5-8 min)")
    mode.add_argument("--gpu", action="store_true", help="GPU suite (CUDA; SmolLM2 and Llama-3-8B shapes, bf16)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repetition (tests)")
    parser.add_argument("--dry-run", action="store_true", help="with --gpu: the GPU suite's code on CPU, tiny shapes")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output folder")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--only", default=None,
                        help="comma-separated sections: attention, overhead, end_to_end, bandwidth (the triton "
                             "executor's dense path and its launch settings against copy bandwidth, at T >= 32k) "
                             "and parity (--gpu: every layer's decisions on the device against the CPU's); default: "
                             "attention, overhead, end_to_end, and parity with --gpu")
    parser.add_argument("--models", default=None,
                        help="end-to-end: comma-separated models of the suite to decode (default: all)")
    parser.add_argument("--lengths", default=None, help="end-to-end: only these context lengths (comma-separated)")
    parser.add_argument("--batches", default=None, help="end-to-end: only these batch sizes (comma-separated)")
    parser.add_argument("--configs", default=None,
                        help="end-to-end: only these configurations (comma-separated names; dense always runs)")
    parser.add_argument("--note", default="", help="a note written at the top of the markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def suite_name(args: argparse.Namespace) -> str:
    if args.gpu:
        return "gpu-dryrun" if args.dry_run else "gpu"
    if args.dry_run:
        raise SystemExit("--dry-run goes with --gpu")
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def select_workloads(suite, args: argparse.Namespace) -> list:
    """The suite's end-to-end workloads restricted by ``--models``, ``--lengths`` and ``--batches``."""
    workloads = suite.e2e
    if args.models:
        wanted = args.models.split(",")
        unknown = set(wanted) - {w.model for w in suite.e2e}
        if unknown:
            raise SystemExit(f"--models: {sorted(unknown)} not in suite {suite.name} (it has "
                             f"{[w.model for w in suite.e2e]})")  # fmt: skip
        workloads = [w for w in workloads if w.model in wanted]
    for key in ("lengths", "batches"):
        if getattr(args, key):
            wanted = {int(x) for x in getattr(args, key).split(",")}
            workloads = [dataclasses.replace(w, **{key: tuple(x for x in getattr(w, key) if x in wanted)})
                         for w in workloads]  # fmt: skip
            workloads = [w for w in workloads if getattr(w, key)]
    if not workloads:
        raise SystemExit(f"no end-to-end case of suite {suite.name} is left by --models/--lengths/--batches")
    return workloads


def pick_configs(names: str | None, build, batch: int) -> dict:
    """``build(batch)`` restricted to ``names`` (comma-separated; ``dense``, the reference, always kept)."""
    configs = build(batch)
    if not names:
        return configs
    wanted = set(names.split(","))
    unknown = wanted - set(configs)
    if unknown:
        raise ValueError(f"--configs: {sorted(unknown)} not among {sorted(configs)}")
    return {name: config for name, config in configs.items() if name in wanted | {"dense"}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    name = suite_name(args)
    if name == "gpu-dryrun":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported: the kernel runs on CPU
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter without its repeated patching (same results)
        from qada.attention.interpreter import skip_repeated_patching

        skip_repeated_patching()
    import torch

    from benchmarks import attention, end_to_end, models, overhead, parity, report
    from benchmarks.common import machine_info, machine_tag, write_results
    from benchmarks.suites import SUITES

    suite = SUITES[name]
    if suite.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device (use --gpu --dry-run to exercise the code path on the CPU)")
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, flush=True))
    device = torch.device(suite.device)
    default_sections = {*DEFAULT_SECTIONS, *(("parity",) if suite.parity else ())}
    sections = set(args.only.split(",")) if args.only else default_sections
    unknown = sections - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--only: {sorted(unknown)} not among the sections {list(SECTIONS)}")
    if {"attention", "bandwidth"} <= sections:
        raise SystemExit("--only: bandwidth is a part of attention (its dense rows and launch sweep): name one of them")
    if "parity" in sections and not suite.parity:
        raise SystemExit(f"--only: suite {name} has no parity section (the device against the CPU: --gpu)")
    info = machine_info(device)
    argv_used = sys.argv[1:] if argv is None else argv
    results: dict[str, Any] = {
        "suite": name,
        "command": "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in argv_used),
        "machine": info,
        "note": args.note,
        "settings": {k: (v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v))
                     for k, v in vars(suite).items() if k not in ("attention_shapes", "overhead_shapes", "e2e")},
        "errors": [],
    }  # fmt: skip
    results["settings"]["attention_shapes"] = [vars(s) | {"dtype": str(s.dtype)} for s in suite.attention_shapes]
    workloads = select_workloads(suite, args)
    results["settings"]["e2e"] = [dataclasses.asdict(w) for w in workloads]
    stem = f"{name}-{machine_tag(info)}"
    if sections != default_sections:  # a partial run must not overwrite the whole one
        stem += "-" + "_".join(sorted(sections))
    if workloads != suite.e2e and "end_to_end" in sections:
        stem += "-" + "_".join(w.model for w in workloads)
        stem += "".join(f"-{key[0].upper()}{getattr(args, key).replace(',', '_')}" for key in ("lengths", "batches")
                        if getattr(args, key))  # fmt: skip
    if args.configs and "end_to_end" in sections:
        stem += "-some_configs"
    started = time.perf_counter()

    def save() -> None:
        results["goals"] = report.evaluate_goals(results)
        results["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_results(args.out, stem, results, report.markdown(results))

    def section(key: str, fn) -> None:
        if key not in sections:
            return
        log(f"[{key}] ({time.perf_counter() - started:.0f} s)")
        try:
            fn()
        except Exception as exc:  # keep going: a failed section must not lose the others
            results["errors"].append(f"{key}: {exc!r}"[:500])
            log(traceback.format_exc())
        except KeyboardInterrupt:  # (a stage's time limit): what the section measured so far is saved, then stop
            results["errors"].append(f"{key}: interrupted (KeyboardInterrupt)")
            save()
            raise
        save()

    log(f"suite {name} on {info.get('gpu') or info['cpu']} ({info['cores']} cores, {info['torch_threads']} threads)")
    with torch.no_grad():

        def measure_copy_bandwidth() -> None:  # the reference of every bandwidth the attention sections give
            results["copy_bandwidth"] = attention.copy_bandwidth(device, suite.copy_bytes,
                                                                 reps=max(3, suite.attention_reps))
            log(f"  copy bandwidth {results['copy_bandwidth']['bandwidth_gbs']:.1f} GB/s")

        def run_attention() -> None:
            measure_copy_bandwidth()
            results["attention"] = attention.run_attention(
                suite.attention_shapes, suite.attention_lengths, suite.executors, device,
                suite.attention_reps, suite.attention_inner, suite.flex_compile, log,
            )  # fmt: skip
            if "triton" in suite.executors:  # CUDA only: the dense path's launch parameters against copy bandwidth
                results["dense_sweep"] = attention.dense_launch_sweep(
                    suite.attention_shapes, suite.attention_lengths, device, suite.attention_reps,
                    suite.attention_inner, log)

        def run_bandwidth() -> None:  # issue 33's dense at bandwidth alone: minutes less than the attention section
            measure_copy_bandwidth()
            lengths = [t for t in suite.attention_lengths if t >= 32768] or suite.attention_lengths[-1:]  # (dry run)
            attention.run_attention(suite.attention_shapes, lengths, ["triton"], device, suite.attention_reps,
                                    suite.attention_inner, suite.flex_compile, log, local_groups=[0],
                                    rows=results.setdefault("attention", []))  # fmt: skip
            attention.dense_launch_sweep(suite.attention_shapes, lengths, device, suite.attention_reps,
                                         suite.attention_inner, log, rows=results.setdefault("dense_sweep", []))

        def run_overhead() -> None:
            results["overhead"] = overhead.run_overhead(
                suite.overhead_shapes, suite.overhead_lengths, device, suite.overhead_reps, suite.overhead_inner, log
            )

        def run_end_to_end() -> None:
            if "copy_bandwidth" not in results:  # the byte ceiling needs it
                results["copy_bandwidth"] = attention.copy_bandwidth(device, suite.copy_bytes, reps=3)
            results.setdefault("models", {})
            results.setdefault("end_to_end", [])

            def case_done(rows: list[dict[str, Any]]) -> None:  # saved after every case: a killed run keeps them
                results["end_to_end"] += rows
                results["errors"] += [f"end_to_end {r['model']} T={r['T']} B={r['B']} {r['config']}: {r['error']}"
                                      for r in rows if "error" in r]  # fmt: skip
                save()

            for workload in workloads:
                try:  # a model that fails must not lose the others
                    log(f"  model {workload.model}")
                    extra = suite.e2e_warmup + suite.e2e_steps + suite.e2e_count_steps + 16
                    model, tokenizer, what = models.build_model(suite, workload, max(workload.lengths) + extra)
                    results["models"][workload.model] = what
                    end_to_end.run_end_to_end(
                        model, models.build_contexts(suite, workload, model, tokenizer),
                        functools.partial(pick_configs, args.configs,
                                          functools.partial(models.build_configs, suite, workload, model, tokenizer)),
                        suite.e2e_steps, suite.e2e_reps, device, log,
                        bandwidth_gbs=(results.get("copy_bandwidth") or {}).get("bandwidth_gbs"),
                        warmup=suite.e2e_warmup, count_steps=suite.e2e_count_steps, model_name=workload.model,
                        on_case=case_done,
                    )
                except Exception as exc:
                    results["errors"].append(f"end_to_end {workload.model}: {exc!r}"[:500])
                    log(traceback.format_exc())
                finally:
                    model = tokenizer = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                save()

        def run_parity_section() -> None:
            rows = results.setdefault("parity", [])

            def row_done(row: dict[str, Any]) -> None:  # saved after every case: a killed run keeps them
                rows.append(row)
                if "error" in row:
                    results["errors"].append(f"parity {row['criterion']} {row['moments']} {row['executor']}"
                                             f"{' compiled' if row['compiled'] else ''}: {row['error']}")
                save()

            parity.run_parity(suite.parity, device, log, on_row=row_done)

        section("attention", run_attention)
        section("bandwidth", run_bandwidth)
        section("overhead", run_overhead)
        section("end_to_end", run_end_to_end)
        section("parity", run_parity_section)
    save()
    report.print_tables(results, log=print if not args.quiet else (lambda *a: None))
    log(f"wrote {Path(args.out) / stem}.json and .md in {time.perf_counter() - started:.0f} s")
    return results


if __name__ == "__main__":
    main()
