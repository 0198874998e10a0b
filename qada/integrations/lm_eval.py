"""qada as a model of EleutherAI's lm-evaluation-harness (issue 24): ``--model qada``.

:class:`QAdaLM` is lm-eval's Hugging Face model (``HFLM``) with a qada run attached while it *generates*: every
``generate_until`` request decodes with the configured criterion, moment source and executor, and the run's
statistics are kept per task. Log-likelihood requests are one forward over the whole sequence, with no decode
step; qada changes nothing there, and the results say so (``qada_active: false``) instead of pretending.

lm-eval 0.4 has no entry point for outside models, so the model is registered by :func:`register` (``"qada"``)
and the command line is lm-eval's own, run by this module, which registers first and forwards every flag::

    python -m qada.integrations.lm_eval run --model qada \\
        --model_args pretrained=smollm2-135m,criterion=qada_tail,tau=0.3 \\
        --tasks my_task --include_path tasks/ --output_path out/

A criterion mapping goes in a JSON ``--model_args`` (lm-eval parses ``{`` only as JSON):
``--model_args '{"pretrained": "smollm2-135m", "criterion": {"name": "any_of", "criteria": ["local", "qada"]}}'``,
or in a file: ``criterion=composed.yaml``.

Per task, the statistics go into lm-eval's results (``results["config"]["qada"]``, also in ``--output_path``'s
file) and are printed after lm-eval's table: sparsity, kv_sparsity (global layers and all layers), kv_read,
fail-safe count, decode tokens/s, and the full qada configuration with its identity digest.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from lm_eval.api.registry import model_registry
from lm_eval.models.huggingface import HFLM

from qada.integrations.lm_eval_args import QAdaArgs, QAdaArgumentError, parse_qada_args

__all__ = ["MODEL_NAME", "QAdaLM", "main", "qada_table", "register"]

MODEL_NAME = "qada"

#: While :func:`main` runs: the models it made (for the table it prints after lm-eval's), else ``None``.
_made: list[QAdaLM] | None = None


def hf_parameters() -> list[str]:
    """The keyword parameters of lm-eval's ``HFLM`` (what ``model_args`` may hold besides qada's)."""
    import inspect

    return [name for name, p in inspect.signature(HFLM.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


class QAdaLM(HFLM):
    """lm-eval's ``HFLM`` decoding with qada. ``model_args`` (every one optional):

    * ``pretrained``: an embedded model's name (``smollm2-135m``, ``gemma3-270m``), a transformers model directory
      or a GGUF file (default ``smollm2-135m``);
    * ``criterion`` (a name or a YAML/JSON mapping, as ``qada eval --criterion``), ``tau``, ``moments``,
      ``executor``, ``window`` (an int ``t_local`` or a mapping), ``static`` (a head-mask file from ``qada
      calibrate``, instead of ``criterion``), ``config`` (a YAML run config), ``imports`` (plugin modules,
      separated by ``;``), ``device`` (``cpu``, ``cuda``, ``auto``), ``dtype`` (``auto``, ``float32``, ...);
    * anything else goes to ``HFLM`` (``batch_size``, ``max_length``, ...); a key that neither takes (a misspelt
      ``tua=0.1``) is an error, not dropped.
    """

    def __init__(self, **model_args: Any) -> None:
        qada_args, rest = parse_qada_args(model_args, others=hf_parameters())
        model, tokenizer, self.qada_config = _load(qada_args)
        self.qada_args = qada_args
        self._qada_run = self.qada_config.build()
        from qada.models import prepare_run

        prepare_run(self._qada_run, model, tokenizer)
        self._qada_name = qada_args.pretrained
        super().__init__(pretrained=model, tokenizer=tokenizer, **rest)
        self.qada_tasks: dict[str, dict[str, Any]] = {}
        if _made is not None:
            _made.append(self)

    # --- what the harness calls ------------------------------------------------------------------------------
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """HFLM's generation with the run attached, one task at a time (so that every task gets its own statistics);
        answers come back in the requests' order."""
        out: list[str | None] = [None] * len(requests)
        for task, indices in _by_task(requests).items():
            self.qada_tasks.setdefault(task, _empty_stats())
            answers = self._generate_attached(task, [requests[i] for i in indices], disable_tqdm)
            for i, answer in zip(indices, answers, strict=True):
                out[i] = answer
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
        self._count_unchanged(requests, "loglikelihood")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
        self._count_unchanged(requests, "loglikelihood_rolling")
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval writes under ``results["config"]``: the model (no Hub lookup: qada's models are local) and
        ``qada``: the configuration, its digest and the statistics per task."""
        return {
            "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
            "model_dtype": str(self._model.dtype),
            "model_revision": "local",
            "model_sha": "",
            "qada": self.qada_summary(),
        }

    # --- qada's side ----------------------------------------------------------------------------------------
    def qada_summary(self) -> dict[str, Any]:
        """``{"pretrained", "configuration", "digest", "tasks": {task: statistics}}``."""
        configuration, digest = self.qada_identity()
        return {"pretrained": self._qada_name, "configuration": configuration, "digest": digest,
                "tasks": {task: _finished(stats) for task, stats in sorted(self.qada_tasks.items())}}

    def qada_identity(self) -> tuple[dict[str, Any], str]:
        """The full qada configuration (criterion, moments, executor, window, the model's fingerprint, versions)
        and its digest, as ``qada eval`` computes them (:mod:`qada.eval.identity`)."""
        import torch
        import transformers

        from qada.artifacts import model_fingerprint
        from qada.eval.identity import artifact_digests, digest, plain
        from qada.version import __version__

        fields = plain({k: v for k, v in self.qada_config.to_dict().items() if k != "label"})
        configuration = {**fields, "artifacts": artifact_digests(fields),
                         "model": model_fingerprint(self._model.config, self._model),
                         "dtype": str(self._model.dtype), "device": str(self._model.device),
                         "versions": {"qada": __version__, "torch": torch.__version__,
                                      "transformers": transformers.__version__}}
        return configuration, digest(configuration)

    def _generate_attached(self, task: str, requests: list, disable_tqdm: bool) -> list[str]:
        from qada.models import attach

        run = self._qada_run
        stats = self.qada_tasks[task]
        stats["requests"]["generate_until"] += len(requests)
        attach(self._model, run)  # the dense criterion too: qada's attention path, every head reading the bulk
        run.reset_stats()
        self._timing = dict.fromkeys(("generated_tokens", "decode_tokens", "prefill_seconds", "decode_seconds"), 0)
        start = time.perf_counter()
        try:
            answers = super().generate_until(requests, disable_tqdm=disable_tqdm)
        finally:
            run.remove()
        stats["seconds"] += time.perf_counter() - start
        for name, value in self._timing.items():
            stats[name] += value
        stats["runs"].append(run.summary())
        stats["qada_active"] = True
        return answers

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """HFLM's generation, timed: the first forward is the prompt's prefill, the rest the decode steps (their
        tokens and seconds give ``decode_tokens_per_s``; the first new token comes from the prefill)."""
        import torch

        sync = torch.cuda.synchronize if self._model.device.type == "cuda" else (lambda: None)
        ends: list[float] = []

        def mark(*_: Any) -> None:
            if not ends:  # the prefill's end; later forwards are decode steps
                sync()
                ends.append(time.perf_counter())

        handle = self._model.register_forward_hook(mark)
        sync()
        start = time.perf_counter()
        try:
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        finally:
            handle.remove()
        sync()
        end = time.perf_counter()
        new = max(int(out.shape[1]) - int(context.shape[1]), 0)
        self._timing["generated_tokens"] += int(out.shape[0]) * new
        if ends:
            self._timing["prefill_seconds"] += ends[0] - start
            if new > 1:
                self._timing["decode_tokens"] += int(out.shape[0]) * (new - 1)
                self._timing["decode_seconds"] += end - ends[0]
        return out

    def _count_unchanged(self, requests: list, kind: str) -> None:
        for task, indices in _by_task(requests).items():
            stats = self.qada_tasks.setdefault(task, _empty_stats())
            stats["requests"][kind] += len(indices)


def _load(args: QAdaArgs) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, EvalConfig)``; every problem is a :class:`QAdaArgumentError`."""
    import torch

    from qada.cli.common import build_eval_config, resolve_device, resolve_dtype, static_mask_spec
    from qada.models import load_model

    requested = args.device
    if requested.startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's convention (its --device defaults to cuda:0; its hf model falls back the same way)
        logging.getLogger(__name__).warning("device %s requested but CUDA is not available: using the CPU",
                                            requested)
        requested = "cpu"
    try:
        device = resolve_device(requested)
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as error:
        raise QAdaArgumentError(f"model_args device/dtype: {error}") from None
    file_config = dict(args.config)
    for key in ("moments", "executor", "window"):
        if getattr(args, key) is not None:
            file_config[key] = getattr(args, key)
    def configured(spec: Any) -> Any:
        try:
            return build_eval_config(spec, args.tau, None, None, file_config, label="qada")
        except (ValueError, TypeError, KeyError, FileNotFoundError) as error:
            raise QAdaArgumentError(f"model_args: {str(error).splitlines()[0] if str(error) else error!r}") from None

    if args.static is None:  # a bad criterion fails before the model loads
        config = configured(args.criterion if args.criterion is not None else file_config.get("criterion", "qada"))
    try:
        model, tokenizer = load_model(args.pretrained, dtype=dtype, device=device)
    except (OSError, ValueError) as error:
        raise QAdaArgumentError(f"model_args pretrained={args.pretrained!r}: {error}") from None
    try:
        if args.static is not None:  # the head mask is checked against the model it was calibrated on
            config = configured(static_mask_spec(args.static, model))
        from qada.models.apply import check_run_fits

        check_run_fits(config.build(), model)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as error:
        raise QAdaArgumentError(f"model_args: {str(error).splitlines()[0] if str(error) else error!r}") from None
    return model, tokenizer, config


def _by_task(requests: Sequence) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
        groups.setdefault(str(getattr(request, "task_name", None) or "?"), []).append(i)
    return groups


def _empty_stats() -> dict[str, Any]:
    return {"requests": {"generate_until": 0, "loglikelihood": 0, "loglikelihood_rolling": 0}, "seconds": 0.0,
            "generated_tokens": 0, "decode_tokens": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0, "runs": [],
            "qada_active": False}


_MEANS = ("sparsity", "kv_sparsity", "sparsity_all_layers", "kv_sparsity_all_layers", "kv_read")


def _finished(stats: dict[str, Any]) -> dict[str, Any]:
    """One task's statistics: the runs' means (weighted by their decode steps), fail-safe count, tokens/s."""
    runs = [r for r in stats["runs"] if r.get("decode_steps")]  # a run without a decode step has no means
    steps = [float(r["decode_steps"]) for r in runs]
    out: dict[str, Any] = {"requests": dict(stats["requests"]), "qada_active": stats["qada_active"]}
    for name in _MEANS:
        values = [(r.get(name), w) for r, w in zip(runs, steps, strict=True) if r.get(name) is not None]
        out[name] = sum(v * w for v, w in values) / sum(w for _, w in values) if values else None
    out["fail_safe"] = int(sum(r.get("fail_safe", 0) or 0 for r in runs))
    out["generated_tokens"] = stats["generated_tokens"]
    out["generate_seconds"] = round(stats["seconds"], 3)
    out["prefill_seconds"] = round(stats["prefill_seconds"], 3)
    out["decode_seconds"] = round(stats["decode_seconds"], 3)
    out["decode_tokens_per_s"] = (stats["decode_tokens"] / stats["decode_seconds"] if stats["decode_seconds"] > 0
                                  else None)  # decode steps only: the prompts' prefills are timed apart
    if not stats["requests"]["generate_until"]:
        out["note"] = ("log-likelihood requests only: one forward over the whole sequence, no decode step, so qada "
                       "changed nothing for this task")
    return out


def qada_table(summary: dict[str, Any]) -> str:
    """A markdown table of :meth:`QAdaLM.qada_summary` (one row per task)."""

    def number(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"qada: {summary['configuration'].get('criterion')} (digest {summary['digest'][:12]}, "
             f"{summary['pretrained']})", "",
             "| task | requests | qada active | sparsity | kv_sparsity | kv_sparsity all layers | kv_read | "
             "fail-safe | decode tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for task, s in summary["tasks"].items():
        requests = ", ".join(f"{k} {v}" for k, v in s["requests"].items() if v)
        lines.append(f"| {task} | {requests} | {'yes' if s['qada_active'] else 'no'} | {number(s['sparsity'])} | "
                     f"{number(s['kv_sparsity'])} | {number(s['kv_sparsity_all_layers'])} | {number(s['kv_read'])} "
                     f"| {s['fail_safe']} | {number(s['decode_tokens_per_s'], 1)} |")
    notes = {s["note"] for s in summary["tasks"].values() if s.get("note")}
    return "\n".join(lines + [f"\n{note}" for note in sorted(notes)])


def register() -> None:
    """Register :class:`QAdaLM` with lm-eval under ``"qada"`` (idempotent)."""
    if MODEL_NAME not in model_registry or model_registry.get(MODEL_NAME) is not QAdaLM:
        model_registry.register(MODEL_NAME)(QAdaLM)


def _log_to_current_stderr() -> None:
    """Point lm-eval's console handlers at today's ``sys.stderr``. lm-eval makes its handler once per process, bound
    to the ``sys.stderr`` of that moment; a second :func:`main` in the same process (a notebook, a test run that
    captured the first call's output) would otherwise write to a stream that may be closed by then."""
    for handler in logging.getLogger("lm_eval").handlers:
        if type(handler) is logging.StreamHandler and handler.stream is not sys.stderr:
            with handler.lock:  # not setStream: it flushes the old stream, which raises once that stream is closed
                handler.stream = sys.stderr


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line with ``--model qada`` registered; a bad qada ``model_args`` is one line, status 2.
    After lm-eval's own output, prints qada's statistics per task (:func:`qada_table`)."""
    global _made
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    register()
    saved = sys.argv
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]  # HarnessCLI reads sys.argv
    _made = []
    try:
        setup_logging()
        _log_to_current_stderr()
        cli = HarnessCLI()
        cli.execute(cli.parse_args())  # parse: lm-eval refuses a --model_args holding "{" unless it is all JSON
    except (QAdaArgumentError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        made, _made = _made, None
        sys.argv = saved
    for model in made:
        if model.qada_tasks:
            print(qada_table(model.qada_summary()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
