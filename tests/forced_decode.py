"""A few forced decode steps through a qada run, with what they decided: shared by the tests that compare two ways of
running the same step (program orders, fused against unfused launches)."""

from __future__ import annotations

import copy

import torch

from qada.eval.decode import prefill, prefill_from_cache
from qada.models import attach, build_run, prepare_run
from qada.models.generation import copy_to_cache
from qada.models.observers import DecisionRecorder

STEPS = [5, 6, 7]
"""The tokens fed after the prompt, one a step."""


def decode(lm, ids, ref: str, criterion, executor, moments: str):
    """``(logits [steps, vocab], {(layer, step): local [1, H]}, summary)`` of :data:`STEPS` decoded after ``ids
    [1, T]`` (on the model's device) on a static cache, the run prepared with ``criterion``, ``executor`` and
    ``moments`` (``"stored"``: the reference file ``ref``, offset 64; else a source's name)."""
    recorder = DecisionRecorder()
    source = {"name": "stored", "path": ref, "offset": 64} if moments == "stored" else moments
    run = prepare_run(build_run(criterion=copy.deepcopy(criterion), moments=source, executor=executor,
                                observers=[recorder], compile=False), lm)
    done = prefill(lm, ids, keep_queries=run.criterion.prompt_queries())
    cache = copy_to_cache(lm, done.cache, "static", ids.shape[1] + len(STEPS) + 1)
    attach(lm, run)
    logits = []
    try:
        prefill_from_cache(run, cache, queries=done.queries)
        for position, token in enumerate(STEPS, start=ids.shape[1]):
            out = lm(input_ids=torch.tensor([[token]], device=ids.device), past_key_values=cache, use_cache=True,
                     cache_position=torch.tensor([position], device=ids.device))
            logits.append(out.logits[0, -1])
        summary = run.summary()
    finally:
        run.remove()
    return torch.stack(logits), {(e.layer, e.step): e.local.bool() for e in recorder.events}, summary
