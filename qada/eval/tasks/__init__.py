"""RULER-compatible long-context tasks: generation sized with the model's tokenizer, import, and scoring.

Importing this package registers the built-in tasks in :data:`TASKS`::

    from qada.eval.tasks import TASKS, score
    samples = TASKS.build("niah_single_2").generate(tokenizer, length=4096, num_samples=10, seed=0)
    score("niah_single_2", predictions, [s.outputs for s in samples])
"""

from qada.eval.tasks.base import TASKS, Built, Sample, Task, count_tokens, format_prompt, register_task
from qada.eval.tasks.niah import NiahTask
from qada.eval.tasks.scoring import (
    postprocess_pred,
    score,
    string_match_all,
    string_match_all_per_sample,
    string_match_part,
    string_match_part_per_sample,
)

__all__ = [
    "TASKS",
    "Built",
    "NiahTask",
    "Sample",
    "Task",
    "count_tokens",
    "format_prompt",
    "postprocess_pred",
    "register_task",
    "score",
    "string_match_all",
    "string_match_all_per_sample",
    "string_match_part",
    "string_match_part_per_sample",
]
