"""RULER-compatible long-context tasks: generation sized with the model's tokenizer, import, and scoring.

Importing this package registers the built-in tasks in :data:`TASKS`::

    from qada.eval.tasks import TASKS, score
    samples = TASKS.build("niah_single_2").generate(tokenizer, length=4096, num_samples=10, seed=0)
    score("niah_single_2", predictions, [s.outputs for s in samples])
"""

from qada.eval.tasks.base import TASKS, Built, Sample, Task, count_tokens, format_prompt, register_task
from qada.eval.tasks.common_words import CommonWordsTask
from qada.eval.tasks.context_free import ContextFreeTask
from qada.eval.tasks.freq_words import FreqWordsTask
from qada.eval.tasks.jsonl import load_ruler_jsonl, save_ruler_jsonl
from qada.eval.tasks.niah import NiahTask
from qada.eval.tasks.qa import QATask
from qada.eval.tasks.scoring import (
    postprocess_pred,
    score,
    string_match_all,
    string_match_all_per_sample,
    string_match_part,
    string_match_part_per_sample,
)
from qada.eval.tasks.variable_tracking import VariableTrackingTask

__all__ = [
    "TASKS",
    "Built",
    "CommonWordsTask",
    "ContextFreeTask",
    "FreqWordsTask",
    "NiahTask",
    "QATask",
    "Sample",
    "Task",
    "VariableTrackingTask",
    "count_tokens",
    "format_prompt",
    "load_ruler_jsonl",
    "postprocess_pred",
    "register_task",
    "save_ruler_jsonl",
    "score",
    "string_match_all",
    "string_match_all_per_sample",
    "string_match_part",
    "string_match_part_per_sample",
]
