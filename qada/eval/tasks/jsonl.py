"""Import RULER-format jsonl files (``{"input", "outputs"}`` per line) produced elsewhere, e.g. by RULER itself."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qada.eval.tasks.base import Sample, count_tokens

__all__ = ["load_ruler_jsonl", "save_ruler_jsonl"]

_KNOWN = {"index", "input", "outputs", "output", "length", "answer_prefix", "task", "template", "tokens_to_generate"}


def load_ruler_jsonl(
    path: str | os.PathLike, task: str | None = None, tokenizer: Any = None, template: str = "base"
) -> list[Sample]:
    """Samples from a RULER jsonl.

    Each line needs ``input`` (str) and ``outputs`` (list of str; RULER's evaluator also accepts a single
    ``output``). Optional: ``index`` (default: the line's position), ``length`` (RULER's count, which includes
    the generation budget: kept as ``metadata["ruler_length"]``), ``answer_prefix`` (newer RULER keeps it out
    of ``input``: it is then appended, so that ``input`` is always what the model completes), ``task``,
    ``template``, ``tokens_to_generate``; other fields go to ``metadata``.

    Args:
        path: the jsonl file (RULER writes ``{save_dir}/{task}/validation.jsonl``).
        task: the task name; default the line's ``task`` field, else the file's folder name.
        tokenizer: if given, ``Sample.length`` is the token count of ``input``; else ``None``.
        template: how the prompts were templated, when the lines do not say (``"base"`` or ``"chat"``).
    """
    path = Path(path)
    default_task = task or path.parent.name or path.stem
    if path.is_dir():
        raise IsADirectoryError(f"data file {str(path)!r} is a folder; give a jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    samples = []
    seen: dict[int, int] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object but got {type(row).__name__}")
            if not isinstance(row.get("input"), str):
                raise ValueError(f"{where}: expected a string field 'input' but got {row.get('input')!r:.80}")
            outputs = row["outputs"] if "outputs" in row else [row["output"]] if "output" in row else None
            if not (isinstance(outputs, list) and all(isinstance(o, str) for o in outputs)):
                raise ValueError(f"{where}: expected 'outputs' to be a list of strings but got {outputs!r:.80}")
            prefix = row.get("answer_prefix") or ""
            if not isinstance(prefix, str):
                raise ValueError(f"{where}: expected a string 'answer_prefix' but got {prefix!r:.80}")
            text = row["input"] if row["input"].endswith(prefix) else row["input"] + prefix
            kind = row.get("template", template)
            metadata = {k: v for k, v in row.items() if k not in _KNOWN}
            if "length" in row:
                metadata["ruler_length"] = row["length"]
            index = _integer(row.get("index", number - 1), "index", where, minimum=0)
            if index in seen:
                raise ValueError(f"{where}: index {index} appears twice (first on line {seen[index]}); each sample "
                                 "needs its own index")
            seen[index] = number
            budget = _integer(row.get("tokens_to_generate", 128), "tokens_to_generate", where, minimum=1)
            samples.append(
                Sample(
                    task=row.get("task") or default_task,
                    index=index,
                    input=text,
                    outputs=list(outputs),
                    answer_prefix=prefix,
                    length=count_tokens(tokenizer, text, kind) if tokenizer is not None else None,
                    template=kind,
                    tokens_to_generate=budget,
                    metadata=metadata,
                )
            )
    if not samples:
        raise ValueError(f"data file {str(path)!r} holds no samples (no non-empty lines)")
    return samples


def _integer(value: Any, field: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: expected {field!r} to be an integer >= {minimum} but got {value!r:.80}")
    return value


def save_ruler_jsonl(samples: list[Sample], path: str | os.PathLike) -> None:
    """Write samples as RULER jsonl lines (:meth:`Sample.to_ruler`), readable by RULER and :func:`load_ruler_jsonl`."""
    with open(path, "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample.to_ruler()) + "\n")
