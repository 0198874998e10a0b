"""An lm-eval task folder made from qada's RULER generators: a YAML and its local jsonl, offline (issue 24).

``write_task`` writes ``<out>/<name>.yaml`` and ``<out>/<name>.jsonl``: a ``generate_until`` task (greedy, until a
newline) whose prompts are qada's (``niah_single_1``, ``passkey``-like needles...), scored by lm-eval's
``exact_match`` on the first number of the answer (the needles of the ``niah_*`` tasks with numeric values are
numbers). The YAML names its jsonl by absolute path, so ``--include_path <out>`` works from any directory::

    python -m qada.integrations.lm_eval_task --task niah_single_1 --length 1024 --samples 10 --out lm_eval_tasks
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "task_yaml", "write_task"]


def task_yaml(name: str, data: Path, max_gen_toks: int) -> str:
    """The task's YAML (lm-eval 0.4): the jsonl at ``data``, ``exact_match`` on the answer's first number."""
    return f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data.resolve()))}
test_split: test
output_type: generate_until
doc_to_text: "{{{{input}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(out: str | Path, task: str, length: int, samples: int, seed: int, tokenizer: Any,
               name: str | None = None) -> Path:
    """Write the task folder (see the module docstring); returns the YAML's path. ``name``: the lm-eval task name
    (default ``qada_<task>``)."""
    from qada.eval.tasks import TASKS

    name = name or f"qada_{task}"
    built = TASKS.build(task).generate(tokenizer, length, samples, seed)
    rows = []
    for sample in built:
        numbers = [o for o in sample.outputs if o.strip().isdigit()]
        if len(sample.outputs) != 1 or not numbers:
            raise ValueError(f"task {task!r} has answers {sample.outputs!r}: the lm-eval task scores one numeric "
                             "answer per prompt (use niah_single_1, niah_single_2 or niah_multikey_1)")
        rows.append({"input": sample.input, "answer": numbers[0].strip(), "index": sample.index})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    budget = max(s.tokens_to_generate for s in built)
    path = out / f"{name}.yaml"
    path.write_text(task_yaml(name, data, budget))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qada.integrations.lm_eval_task", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="the model whose tokenizer sizes the prompts (default: the "
                        "embedded smollm2-135m)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_directory(args.model))
        path = write_task(args.out, args.task, args.length, args.samples, args.seed, tokenizer, args.name)
    except (ValueError, KeyError, OSError) as error:
        parser.exit(2, f"error: {error}\n")
    print(f"wrote {path} ({args.samples} prompts of {args.length} tokens); run it with --include_path {args.out} "
          f"--tasks {path.stem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
