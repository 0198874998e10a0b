"""The evaluator: greedy generation per sample under many configurations, scored, with resumable results.

Built on Lightning Fabric: samples are sharded over processes (``Fabric(devices=N, strategy="ddp")``, CPU with
gloo or GPUs with NCCL), metrics are torchmetrics and sync across processes at :meth:`Evaluator.compute`. Each
sample is prefilled once (dense) and every configuration decodes from a copy of that cache. Every finished
(sample, configuration) pair is appended whole to ``results-rank{r}.jsonl`` at once (flushed to disk, under a
lock: :mod:`qada.eval.results_file`), so an interrupted run resumes without recomputing it; every row carries the
run's identity digests (:mod:`qada.eval.identity`), and a folder of another run is refused rather than mixed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qada.eval._extra import require_eval_extra
from qada.eval.configs import EvalConfig
from qada.eval.decode import decode_greedy, prefill
from qada.eval.identity import (
    ResultsMismatchError,
    artifact_digests,
    differences,
    digest,
    plain,
    sample_digest,
)
from qada.eval.metrics import ConfigMetrics, OracleAgreement, agreement_summary
from qada.eval.results_file import ResultsFile, read_rows, write_json
from qada.eval.tasks import Sample, score
from qada.models.layer_types import layer_types
from qada.models.statistics import all_layer_sparsity

__all__ = ["Evaluator", "answer_budget", "model_device", "sample_key"]


def sample_key(sample: Sample) -> str:
    return f"{sample.task}/{sample.length}/{sample.template}/{sample.index}"


def model_device(model: Any) -> torch.device:
    """The device of the model's weights (the CPU for a model without parameters)."""
    first = next(model.parameters(), None) if hasattr(model, "parameters") else None
    return first.device if first is not None else torch.device("cpu")


def _single_process_fabric(Fabric: Any, device: torch.device) -> Any:
    """One process on ``device``: the CPU, or the model's GPU (its metrics and oracle agreement live there too)."""
    if device.type == "cuda":
        return Fabric(accelerator="cuda", devices=[device.index or 0])
    return Fabric(accelerator="cpu", devices=1)


#: The fields every results row has (a resumed row without them is refused).
#: Sparsity over all layers, sliding-window layers (hybrid models) counted as local; ``sparsity`` and
#: ``kv_sparsity`` are over the global layers qada decides on.
ALL_LAYER_FIELDS = ("sparsity_all_layers", "kv_sparsity_all_layers")
# besides: the K/V read per step as a fraction of dense attention's (windows and the criterion's own reads included)
DECODE_FIELDS = (*ALL_LAYER_FIELDS, "kv_read")
ROW_FIELDS = ("sample", "config", "task", "score", "sparsity", "kv_sparsity", "seconds", "new_tokens")

#: Tokens generated beyond the reference answer's length (part of the run identity).
ANSWER_MARGIN = 4


def answer_budget(sample: Sample, tokenizer: Any, margin: int = ANSWER_MARGIN) -> int:
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
        fabric: a launched ``lightning.Fabric`` (default: one process on the model's device, CPU or GPU).
        record_oracle: compare every decision with the oracle (at the config's tau, else 0.6).
        progress: show a progress bar (rank 0).
        settings: what else changes a result and is not in the configs or the samples (seed, template, data
            file digest): part of the run identity that guards resuming (:mod:`qada.eval.identity`).
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
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        Fabric = require_eval_extra("lightning.fabric").Fabric

        labels = [c.label for c in configs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"expected unique configuration labels but got duplicates in {labels}")
        self.model = model
        self.device = model_device(model)  # prompts go where the weights are
        self.fabric = fabric or _single_process_fabric(Fabric, self.device)
        self.layers = layer_types(model)
        self.tokenizer = tokenizer
        self.configs = list(configs)
        self.out_dir = Path(out_dir)
        self.record_oracle = record_oracle
        self.progress = progress
        self.settings = dict(settings or {})
        self.metrics = {c.label: ConfigMetrics().to(self.fabric.device) for c in self.configs}
        self.wall_time = {c.label: 0.0 for c in self.configs}
        self.decode_steps = {c.label: 0 for c in self.configs}
        self._runs: dict[str, Any] = {}
        self.run_digest: str | None = None  # set by :meth:`evaluate`: the digest of :meth:`identity`

    # --- results on disk ---------------------------------------------------------------------------------
    @property
    def results_path(self) -> Path:
        return self.out_dir / f"results-rank{self.fabric.global_rank}.jsonl"

    @property
    def identities_path(self) -> Path:
        return self.out_dir / f"identities-rank{self.fabric.global_rank}.json"

    def identity(self, eos: set[int]) -> dict[str, Any]:
        """What every configuration of this run shares and that changes a result (see :mod:`qada.eval.identity`)."""
        import transformers

        from qada.artifacts import model_fingerprint
        from qada.version import __version__

        return {
            "model": model_fingerprint(self.model.config, self.model),
            "dtype": str(getattr(self.model, "dtype", None)),
            "device": self.device.type,  # where the model ran (a Fabric passed in may name another device)
            "decode": {"strategy": "greedy", "cache": "static", "budget_margin": ANSWER_MARGIN, "eos": sorted(eos),
                       "prefill": "dense"},
            "record_oracle": self.record_oracle,
            "settings": dict(self.settings),
            "versions": {"qada": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
        }

    def config_identity(self, config: EvalConfig) -> dict[str, Any]:
        """A configuration's part of the identity: all its parameters, the digests of the files it names and, for
        criteria that read the prompt's last queries at the prefill, how many they get from the shared prefill."""
        fields = plain({k: v for k, v in config.to_dict().items() if k != "label"})
        identity = {**fields, "artifacts": artifact_digests(fields)}
        queries = 0 if config.family == "dense" else self._run(config).criterion.prompt_queries()
        if queries:  # rows decoded before the shared prefill recorded them (an empty heavy set) do not match
            identity["prompt_queries"] = queries
        return identity

    def _known_identities(self) -> dict[str, Any]:
        """Every rank's digest -> identity (only used to explain a mismatch)."""
        known: dict[str, Any] = {}
        for path in sorted(self.out_dir.glob("identities-rank*.json")):
            known.update(_read_identities(path))
        return known

    def finished(self) -> dict[tuple[str, str], dict]:
        """Every (sample key, config label) already written by any rank (rows of every identity)."""
        done = {}
        for path in sorted(self.out_dir.glob("results-rank*.jsonl")):
            for row in read_rows(path, ROW_FIELDS):
                done[(row["sample"], row["config"])] = row
        return done

    def _check_identity(self, done: dict, shared: dict, run: str, configs: dict[str, str], samples: dict) -> None:
        """Refuse (:class:`ResultsMismatchError`) if any row was written under another identity."""
        known = self._known_identities()
        for (key, label), row in done.items():
            if "run" not in row:
                raise ResultsMismatchError(
                    f"{self.out_dir} holds results written without a run identity (an older qada); move them away "
                    "or use another output")
            if row["run"] != run:
                changes = differences(known[row["run"]], shared) if row["run"] in known else []
                changed = "; ".join(changes) or f"unknown (its identity file is gone; digest {row['run']})"
                raise ResultsMismatchError(
                    f"{self.out_dir} holds results of another run, which would be mixed with this one; use another "
                    f"output or remove them. Changed: {changed}")
            if label in configs and row.get("config_digest") != configs[label]:
                before = known.get(row.get("config_digest"), {})
                after = self.config_identity(next(c for c in self.configs if c.label == label))
                changes = differences(before, after) if before else ["its parameters"]
                raise ResultsMismatchError(
                    f"{self.out_dir}: configuration {label!r} was run with other parameters before; rename it, use "
                    f"another output or remove the old results. Changed: {'; '.join(changes)}")
            if key in samples and row.get("sample_digest") != samples[key]:
                raise ResultsMismatchError(
                    f"{self.out_dir}: sample {key!r} had another prompt or answer before (the data changed); use "
                    "another output or remove the old results")

    def _update(self, row: dict) -> None:
        metrics = self.metrics[row["config"]]
        metrics["score"].update(torch.tensor(row["score"], dtype=torch.float32))
        if row["sparsity"] is not None:
            metrics["sparsity"].update(torch.tensor(row["sparsity"], dtype=torch.float32))
            metrics["kv_sparsity"].update(torch.tensor(row["kv_sparsity"], dtype=torch.float32))
        for name in DECODE_FIELDS:
            if row.get(name) is not None:
                metrics[name].update(torch.tensor(row[name], dtype=torch.float32))
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

    def _tokenized(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Every prompt's token ids, checked before any work: non-empty and within the model's positions."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        out = []
        for sample in samples:
            ids = self.tokenizer(sample.input, return_tensors="pt", add_special_tokens=False)["input_ids"]
            if ids.shape[1] == 0:
                raise ValueError(f"sample {sample_key(sample)!r} has an empty prompt")
            needed = ids.shape[1] + answer_budget(sample, self.tokenizer)
            if limit is not None and needed > limit:
                raise ValueError(f"sample {sample_key(sample)!r} needs {needed} positions ({ids.shape[1]} prompt + "
                                 f"answer tokens) but the model has {limit} (max_position_embeddings)")
            out.append(ids)
        return out

    def evaluate(self, samples: Sequence[Sample]) -> dict[str, dict]:
        """Run every configuration on this rank's share of ``samples``; returns :meth:`compute`.

        Checked before the first sample runs: samples (at least one, unique keys, prompts that fit the model),
        every configuration built and bound to the model (artifacts vs. model), the results folder's identity
        (rows of another run are refused, never mixed) and its lock (a second writer is refused).
        """
        from tqdm.auto import tqdm

        samples = list(samples)
        if not samples:
            raise ValueError("expected at least one sample but got none")
        keys = [sample_key(s) for s in samples]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"expected unique samples but {repeated[:3]} appear more than once (duplicate indices)")
        mine = samples[self.fabric.global_rank :: self.fabric.world_size]
        token_ids = dict(zip((sample_key(s) for s in mine), self._tokenized(mine), strict=True))
        keep_queries = 0  # the prompt queries the criteria read at the prefill (the tail-aware ones' heavy set)
        for config in self.configs:  # build every run first: bad parameters or artifacts fail before any work
            if config.family != "dense":
                keep_queries = max(keep_queries, self._run(config).criterion.prompt_queries())
        eos = {self.tokenizer.eos_token_id} | set(_as_list(getattr(self.model.generation_config, "eos_token_id", None)))
        eos.discard(None)
        shared = self.identity(eos)
        run_digest = self.run_digest = digest(shared)
        config_digests = {c.label: digest(self.config_identity(c)) for c in self.configs}
        sample_digests = {sample_key(s): sample_digest(s) for s in mine}

        with ResultsFile(self.results_path) as results:
            done = self.finished()
            self._check_identity(done, shared, run_digest, config_digests, sample_digests)
            known = {run_digest: shared, **{config_digests[c.label]: self.config_identity(c) for c in self.configs}}
            write_json(self.identities_path, {**_read_identities(self.identities_path), **known})
            for (key, label), row in done.items():  # resume: count this rank's finished work once, on this rank
                if label in self.metrics and key in token_ids:
                    self._update(row)
            todo = [(s, c) for s in mine for c in self.configs if (sample_key(s), c.label) not in done]
            bar = tqdm(total=len(todo), desc="qada eval", disable=not self.progress or self.fabric.global_rank != 0)
            by_sample: dict[str, list[EvalConfig]] = {}
            for sample, config in todo:
                by_sample.setdefault(sample_key(sample), []).append(config)
            for sample in mine:
                configs = by_sample.get(sample_key(sample), [])
                if not configs:
                    continue
                start = time.perf_counter()
                prefilled = prefill(self.model, token_ids[sample_key(sample)].to(self.device), keep_queries)
                prefill_seconds = time.perf_counter() - start
                budget = answer_budget(sample, self.tokenizer)
                for config in configs:
                    row = self._decode(sample, config, prefilled, budget, eos)
                    row.update(prefill_seconds=prefill_seconds, run=run_digest,
                               config_digest=config_digests[config.label],
                               sample_digest=sample_digests[sample_key(sample)])
                    results.append(row)
                    self._update(row)
                    bar.update(1)
            bar.close()
        return self.compute()

    def _decode(self, sample: Sample, config: EvalConfig, prefilled: Any, budget: int, eos: set[int]) -> dict:
        """Decode one (sample, configuration) pair from the shared prefill; the results row (without digests)."""
        run = None if config.family == "dense" else self._run(config)  # dense: the model as it is
        if run is not None:
            run.reset_stats()
        start = time.perf_counter()
        tokens = decode_greedy(self.model, prefilled, budget, eos, run)
        observed = run.fanout.seconds if run is not None else 0.0  # the oracle agreement's exact masses, ...
        seconds = time.perf_counter() - start - observed  # decoding alone
        prediction = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if run is not None:
            summary = run.summary()
        else:  # the model as it is: no global head is local, every sliding-window head is
            summary = {"sparsity": 0.0, "kv_sparsity": 0.0, "kv_read": 1.0, "fail_safe": 0,
                       "sparsity_per_layer": dict.fromkeys(self.layers.global_layers, 0.0),
                       "kv_sparsity_per_layer": dict.fromkeys(self.layers.global_layers, 0.0)}
            summary.update(all_layer_sparsity(summary, self.layers))
        if len(tokens) == 1:  # no decode step ran: the first token comes from the dense prefill
            summary = {**summary, "sparsity": None, "kv_sparsity": None,
                       **dict.fromkeys(DECODE_FIELDS, None)}
        return {
            "sample": sample_key(sample), "config": config.label, "task": sample.task, "length": sample.length,
            "index": sample.index, "prediction": prediction, "outputs": sample.outputs,
            "score": score(sample.task, [prediction], [sample.outputs]),
            "sparsity": summary["sparsity"], "kv_sparsity": summary["kv_sparsity"],
            "fail_safe": summary.get("fail_safe", 0), "new_tokens": len(tokens), "seconds": seconds,
            "observer_seconds": observed,
            # over all layers, sliding-window layers counted as local (equal to the above without them)
            **{name: summary.get(name) for name in DECODE_FIELDS},
        }

    def compute(self) -> dict[str, dict]:
        """Per-configuration metrics (synced across processes)."""
        results = {}
        for config in self.configs:
            metrics = self.metrics[config.label]
            values = {name: metrics[name].compute() if _updated(metrics[name]) else None
                      for name in ("score", "sparsity", "kv_sparsity", *DECODE_FIELDS)}
            values["oracle"] = metrics["oracle"].compute() if _updated(metrics["oracle"]) else torch.zeros(5)
            missing = {}
            if values["score"] is None:
                missing["score"] = "no sample was evaluated"
            if values["sparsity"] is None:
                missing["sparsity"] = missing["kv_sparsity"] = (
                    "no decode step ran: every answer was one token, which comes from the dense prefill")
            entry = {
                **config.to_dict(),
                "run": self.run_digest,
                "score": _float(values["score"]),
                "sparsity": _float(values["sparsity"]),
                "kv_sparsity": _float(values["kv_sparsity"]),
                **{name: _float(values[name]) for name in DECODE_FIELDS},
                "decode_seconds": self.wall_time[config.label],
                # decode only (the prefill is timed apart, and the observers' time, e.g. the oracle agreement's
                # exact masses, is left out): steps after the first token, cache copy and moment set-up included;
                # None when no decode step ran
                "decode_tokens_per_s": (self.decode_steps[config.label] / self.wall_time[config.label]
                                        if self.decode_steps[config.label] and self.wall_time[config.label] > 0
                                        else None),
            }
            entry.update({f"oracle_{k}" if not k.startswith("oracle") else k: v
                          for k, v in agreement_summary(values["oracle"]).items()})
            if missing:
                entry["missing"] = missing  # why a value is null (summaries never hold NaN)
            results[config.label] = entry
        return results


def _updated(metric: Any) -> bool:
    """Whether any process updated ``metric`` (synced: the oracle may be recorded on some ranks' samples only)."""
    count = torch.tensor(float(metric.update_count), device=metric.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(count)
    return bool(count > 0)


def _read_identities(path: Path) -> dict[str, Any]:
    """An ``identities-rank*.json`` file's digest -> identity mapping; empty if it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _float(value: torch.Tensor | None) -> float | None:
    return None if value is None or not torch.isfinite(value) else float(value)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]
