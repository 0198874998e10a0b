"""The evaluator: greedy generation per sample under many configurations, scored, with resumable results.

Built on Lightning Fabric: samples are sharded over processes (``Fabric(devices=N, strategy="ddp")``, CPU with
gloo or GPUs with NCCL), metrics are torchmetrics and sync across processes at :meth:`Evaluator.compute`. Each
sample is prefilled once (dense) and every configuration decodes from a copy of that cache. Every finished
(sample, configuration) pair is appended to ``results-rank{r}.jsonl`` at once, so an interrupted run resumes
without recomputing it.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qada.eval._extra import require_eval_extra
from qada.eval.configs import EvalConfig
from qada.eval.decode import decode_greedy, prefill
from qada.eval.metrics import ConfigMetrics, OracleAgreement, agreement_summary
from qada.eval.tasks import Sample, score

__all__ = ["Evaluator", "answer_budget", "sample_key"]


def sample_key(sample: Sample) -> str:
    return f"{sample.task}/{sample.length}/{sample.template}/{sample.index}"


def answer_budget(sample: Sample, tokenizer: Any, margin: int = 4) -> int:
    """Tokens to generate: the references' token length (all of them, comma-joined) plus ``margin``, capped by
    the task's own budget. Greedy decoding also stops at EOS."""
    answer = ", ".join(sample.outputs)
    needed = len(tokenizer(" " + answer, add_special_tokens=False)["input_ids"]) + margin
    return max(1, min(needed, sample.tokens_to_generate))


class Evaluator:
    """Evaluate ``configs`` on samples with ``model``.

    Args:
        model, tokenizer: a transformers causal LM and its tokenizer.
        configs: the configurations (see :func:`qada.eval.configs.sweep_configs`).
        out_dir: folder for ``results-rank*.jsonl`` (resume) and ``summary.json``.
        fabric: a launched ``lightning.Fabric`` (default: one CPU process).
        record_oracle: compare every decision with the oracle (at the config's tau, else 0.6).
        progress: show a progress bar (rank 0).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        configs: Sequence[EvalConfig],
        out_dir: str | Path,
        fabric: Any = None,
        record_oracle: bool = False,
        progress: bool = True,
    ) -> None:
        Fabric = require_eval_extra("lightning.fabric").Fabric

        labels = [c.label for c in configs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"expected unique configuration labels but got duplicates in {labels}")
        self.fabric = fabric or Fabric(accelerator="cpu", devices=1)
        self.model = model
        self.tokenizer = tokenizer
        self.configs = list(configs)
        self.out_dir = Path(out_dir)
        self.record_oracle = record_oracle
        self.progress = progress
        self.metrics = {c.label: ConfigMetrics().to(self.fabric.device) for c in self.configs}
        self.wall_time = {c.label: 0.0 for c in self.configs}
        self.decode_steps = {c.label: 0 for c in self.configs}
        self._runs: dict[str, Any] = {}

    # --- results on disk ---------------------------------------------------------------------------------
    @property
    def results_path(self) -> Path:
        return self.out_dir / f"results-rank{self.fabric.global_rank}.jsonl"

    def finished(self) -> dict[tuple[str, str], dict]:
        """Every (sample key, config label) already written by any rank."""
        done = {}
        for path in sorted(self.out_dir.glob("results-rank*.jsonl")):
            lines = path.read_text().splitlines()
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    if number == len(lines):  # a write cut short by an interruption: that pair runs again
                        warnings.warn(f"{path}: ignoring a truncated last line", stacklevel=2)
                        continue
                    raise ValueError(f"{path}:{number} is not a JSON line; the results file is corrupted") from None
                done[(row["sample"], row["config"])] = row
        return done

    def _record(self, row: dict) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with self.results_path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()

    def _update(self, row: dict) -> None:
        metrics = self.metrics[row["config"]]
        metrics["score"].update(torch.tensor(row["score"], dtype=torch.float32))
        if row["sparsity"] is not None:
            metrics["sparsity"].update(torch.tensor(row["sparsity"], dtype=torch.float32))
            metrics["kv_sparsity"].update(torch.tensor(row["kv_sparsity"], dtype=torch.float32))
        self.wall_time[row["config"]] += row["seconds"]
        self.decode_steps[row["config"]] += max(int(row.get("new_tokens", 1)) - 1, 0)  # the first comes from prefill

    # --- the loop ----------------------------------------------------------------------------------------
    def _run(self, config: EvalConfig):
        if config.label not in self._runs:
            from qada.models.apply import prepare_run

            observers = []
            if self.record_oracle and config.family != "dense":
                tau = config.criterion.get("tau", 0.6) if isinstance(config.criterion, dict) else 0.6
                observers.append(OracleAgreement(self.metrics[config.label]["oracle"], tau))
            self._runs[config.label] = prepare_run(config.build(observers), self.model, self.tokenizer)
        return self._runs[config.label]

    def evaluate(self, samples: Sequence[Sample]) -> dict[str, dict]:
        """Run every configuration on this rank's share of ``samples``; returns :meth:`compute`."""
        from tqdm.auto import tqdm

        done = self.finished()
        mine = list(samples)[self.fabric.global_rank :: self.fabric.world_size]
        my_keys = {sample_key(s) for s in mine}
        for (key, label), row in done.items():  # resume: count this rank's finished work once, on this rank
            if label in self.metrics and key in my_keys:
                self._update(row)
        todo = [(s, c) for s in mine for c in self.configs if (sample_key(s), c.label) not in done]
        eos = {self.tokenizer.eos_token_id} | set(_as_list(getattr(self.model.generation_config, "eos_token_id", None)))
        eos.discard(None)
        bar = tqdm(total=len(todo), desc="qada eval", disable=not self.progress or self.fabric.global_rank != 0)
        by_sample: dict[str, list[EvalConfig]] = {}
        for sample, config in todo:
            by_sample.setdefault(sample_key(sample), []).append(config)
        for sample in mine:
            configs = by_sample.get(sample_key(sample), [])
            if not configs:
                continue
            ids = self.tokenizer(sample.input, return_tensors="pt", add_special_tokens=False)["input_ids"]
            start = time.perf_counter()
            prefilled = prefill(self.model, ids.to(self.fabric.device))
            prefill_seconds = time.perf_counter() - start
            budget = answer_budget(sample, self.tokenizer)
            for config in configs:
                run = None if config.family == "dense" else self._run(config)  # dense: the model as it is
                if run is not None:
                    run.reset_stats()
                start = time.perf_counter()
                tokens = decode_greedy(self.model, prefilled, budget, eos, run)
                seconds = time.perf_counter() - start
                prediction = self.tokenizer.decode(tokens, skip_special_tokens=True)
                summary = run.summary() if run is not None else {"sparsity": 0.0, "kv_sparsity": 0.0, "fail_safe": 0}
                if len(tokens) == 1:  # no decode step ran: the first token comes from the dense prefill
                    summary = {**summary, "sparsity": None, "kv_sparsity": None}
                row = {
                    "sample": sample_key(sample), "config": config.label, "task": sample.task, "length": sample.length,
                    "index": sample.index, "prediction": prediction, "outputs": sample.outputs,
                    "score": score(sample.task, [prediction], [sample.outputs]),
                    "sparsity": summary["sparsity"], "kv_sparsity": summary["kv_sparsity"],
                    "fail_safe": summary.get("fail_safe", 0), "new_tokens": len(tokens), "seconds": seconds,
                    "prefill_seconds": prefill_seconds,
                }
                self._record(row)
                self._update(row)
                bar.update(1)
        bar.close()
        return self.compute()

    def compute(self) -> dict[str, dict]:
        """Per-configuration metrics (synced across processes)."""
        results = {}
        for config in self.configs:
            metrics = self.metrics[config.label]
            values = {name: metrics[name].compute() for name in ("score", "sparsity", "kv_sparsity")}
            values["oracle"] = metrics["oracle"].compute() if _updated(metrics["oracle"]) else torch.zeros(5)
            entry = {
                **config.to_dict(),
                "score": float(values["score"]),
                "sparsity": float(values["sparsity"]),
                "kv_sparsity": float(values["kv_sparsity"]),
                "decode_seconds": self.wall_time[config.label],
                # decode only (the prefill is timed apart): steps after the first token, cache copy and moment
                # set-up included; None when no decode step ran
                "decode_tokens_per_s": (self.decode_steps[config.label] / self.wall_time[config.label]
                                        if self.decode_steps[config.label] and self.wall_time[config.label] > 0
                                        else None),
            }
            entry.update({f"oracle_{k}" if not k.startswith("oracle") else k: v
                          for k, v in agreement_summary(values["oracle"]).items()})
            results[config.label] = entry
        return results


def _updated(metric: Any) -> bool:
    """Whether any process updated ``metric`` (synced: the oracle may be recorded on some ranks' samples only)."""
    count = torch.tensor(float(metric.update_count), device=metric.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(count)
    return bool(count > 0)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]
