"""Where the milliseconds of one decode step go: torch.profiler tables for dense and qada on the embedded model.

    python benchmarks/profile_step.py                       # T=7680, 8 profiled steps per configuration
    python benchmarks/profile_step.py --length 4096 --steps 4 --out /tmp/profile

One real prefill of a pass-key prompt; each configuration then decodes from a fresh copy of that cache (warm-up
steps first, then the profiled ones). Writes ``<out>/profile-cpu.md``: per configuration the median step time
and the operators that take the most self CPU time per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=7680, help="prompt length in tokens")
    parser.add_argument("--steps", type=int, default=8, help="profiled decode steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps before profiling")
    parser.add_argument("--rows", type=int, default=22, help="operators listed per configuration")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)

    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import machine_info
    from benchmarks.end_to_end import dense_run, fresh_cache, qada_run
    from qada.eval.decode import prefill, prefill_from_cache
    from qada.eval.passkey import passkey_prompt
    from qada.models import attach, load_default_model

    model, tokenizer = load_default_model()
    prompt = passkey_prompt(tokenizer, length=args.length, depth=0.5)
    with torch.no_grad():
        done = prefill(model, prompt.input_ids)
    base = [(layer.keys, layer.values) for layer in done.cache.layers]
    first = int(done.last_logits.argmax(-1))
    configs = {
        "dense, static cache": ("static", None),
        "dense, dynamic cache": ("dynamic", None),
        "qada dense criterion, static cache": ("static", dense_run("sdpa")),
        "qada tau 0.6 stored, static cache": ("static", qada_run(model, tokenizer, "stored", "sdpa")),
    }
    sections = []
    for name, (kind, run) in configs.items():
        cache = fresh_cache(model, base, kind, args.length + args.warmup + args.steps + 8)
        if run is not None:
            attach(model, run)
            run.reset_stats()
            prefill_from_cache(run, cache)
        token, times = first, []
        try:
            with torch.no_grad():
                for _ in range(args.warmup):
                    token = int(model(input_ids=torch.tensor([[token]]), past_key_values=cache).logits[0, -1].argmax())
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache).logits
                        token = int(logits[0, -1].argmax())
                        times.append(time.perf_counter() - t0)
        finally:
            if run is not None:
                run.remove()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=48)
        median = statistics.median(times)
        print(f"{name}: median step {1e3 * median:.1f} ms (profiled, {args.steps} steps)", flush=True)
        sections.append(f"## {name}\n\nmedian step under the profiler: {1e3 * median:.1f} ms over {args.steps} "
                        f"steps (totals below are over all {args.steps} steps)\n\n```\n{table}\n```\n")
    info = machine_info("cpu")
    header = (f"# Decode-step profile, SmolLM2-135M at T={args.length} (CPU)\n\n"
              f"Command: `python benchmarks/profile_step.py --length {args.length} --steps {args.steps}`; "
              f"{info['cpu']}, {info['cores']} cores, {torch.get_num_threads()} threads, torch {torch.__version__}, "
              f"load average {os.getloadavg()}.\n\n")
    out = Path(args.out) / "profile-cpu.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + "\n".join(sections))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
