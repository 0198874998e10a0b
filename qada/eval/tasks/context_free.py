"""A RULER context with a question that needs no context (the paper's §5, "context-independent" prompts).

The prompt is a niah prompt (instructions, haystack with its needles) whose question is replaced by one the
model can answer without reading the context: two-digit addition (``question="arithmetic"``) or a
general-knowledge question from a fixed list (``question="knowledge"``). Such prompts let one check that
a criterion labels heads local when the context is irrelevant.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from qada.eval.tasks.base import TASKS, Built, Task, register_task
from qada.eval.tasks.niah import NiahTask
from qada.eval.tasks.templates import TASK_TEMPLATES

__all__ = ["KNOWLEDGE_QUESTIONS", "ContextFreeTask"]

KNOWLEDGE_QUESTIONS = (
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the chemical symbol for gold?", "Au"),
    ("How many days are there in a week?", "seven"),
    ("How many legs does a spider have?", "eight"),
    ("What color is the sky on a clear day?", "blue"),
    ("What is the freezing point of water in degrees Celsius?", "0"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("What gas do plants absorb from the air?", "carbon dioxide"),
    ("On which continent is Egypt?", "Africa"),
)

_QUESTION = "\nQuestion: {question}"
_PREFIX = " Answer:"
_NIAH_INSTRUCTION = TASK_TEMPLATES["niah"]["template"].split("{context}")[0]


@dataclass
class ContextFreeTask(Task):
    """A ``context_task`` niah haystack followed by a ``question`` (``"arithmetic"``/``"knowledge"``)."""

    context_task: str = "niah_single_2"
    question: str = "arithmetic"
    template: str = "base"

    tokens_to_generate = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.question not in ("arithmetic", "knowledge"):
            raise ValueError(f"expected question 'arithmetic' or 'knowledge' but got {self.question!r}")
        if not isinstance(self._context, NiahTask):
            raise ValueError(f"expected a niah task as context_task but got {self.context_task!r}")

    @property
    def _context(self) -> Task:
        return TASKS.build(self.context_task)

    def size_range(self, length: int) -> tuple[int, int]:
        return self._context.size_range(length)

    def build(self, rng: random.Random, size: int, length: int, index: int = 0) -> Built:
        niah = self._context
        context, needles, _, _ = niah.context(rng, size)
        if self.question == "arithmetic":
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            question, answer = f"What is {a} + {b}?", str(a + b)
        else:
            question, answer = rng.choice(KNOWLEDGE_QUESTIONS)
        plural = niah.num_needle_k * niah.num_needle_v > 1
        intro = _NIAH_INSTRUCTION if plural else _singular(_NIAH_INSTRUCTION)
        type_needle_v = niah.type_needle_v if plural else niah.type_needle_v[:-1]
        text = intro.format(type_needle_v=type_needle_v) + context + _QUESTION.format(question=question)
        return Built(
            text=text, outputs=[answer], answer_prefix=_PREFIX, needles=needles, metadata={"question": question}
        )


def _singular(text: str) -> str:
    return text.replace("Some", "A").replace("are", "is")


register_task("context_free")(ContextFreeTask)
