"""Question answering over many documents (``qa_1``: SQuAD, ``qa_2``: HotpotQA), RULER's ``qa.py``.

The gold documents of a question are mixed with distractors (for SQuAD first the other paragraphs of the
same article, then random documents) and shuffled; ``size`` counts documents. As in RULER, sample ``i``
asks question ``first_question + i`` of the dataset (in the file's order); the seed picks the distractors
and their order. Scored with ``string_match_part`` (any of the reference answers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from qada.eval.tasks.base import Built, Task, register_task
from qada.eval.tasks.data import qa_data
from qada.eval.tasks.templates import QA_DOCUMENT_PROMPT, TASK_TEMPLATES

__all__ = ["QATask"]

_T = TASK_TEMPLATES["qa"]


@dataclass
class QATask(Task):
    """RULER's qa on ``dataset`` (``"squad"`` or ``"hotpotqa"``)."""

    dataset: str = "squad"
    first_question: int = 0
    template: str = "base"

    metric = "string_match_part"
    tokens_to_generate = _T["tokens_to_generate"]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dataset not in ("squad", "hotpotqa"):
            raise ValueError(f"expected dataset 'squad' or 'hotpotqa' but got {self.dataset!r}")
        if isinstance(self.first_question, bool) or not isinstance(self.first_question, int) or self.first_question < 0:
            raise ValueError(f"expected first_question >= 0 but got {self.first_question!r}")

    def size_range(self, length: int) -> tuple[int, int]:
        _, docs = qa_data(self.dataset)
        return 1, min(len(docs), length // 4 + 1)

    def prepare(self, tokenizer, length: int, seed: int) -> None:
        qa_data(self.dataset)  # load once, outside the timed search

    def build(self, rng: random.Random, size: int, length: int, index: int = 0) -> Built:
        questions, docs = qa_data(self.dataset)
        number = (self.first_question + index) % len(questions)  # RULER: the question of sample i is QAS[i]
        question = questions[number]
        gold, more = list(question["context"]), list(question["more_context"])
        num_docs = max(size, len(gold))
        if num_docs >= len(docs):
            chosen = list(range(len(docs)))
        elif num_docs - len(gold) > len(more):
            excluded = set(gold) | set(more)
            extra: list[int] = []
            seen = set(excluded)
            while len(extra) < num_docs - len(gold) - len(more):  # RULER: random.sample of the other docs
                i = rng.randrange(len(docs))
                if i not in seen:
                    seen.add(i)
                    extra.append(i)
            chosen = gold + more + extra
        else:
            chosen = gold + rng.sample(more, num_docs - len(gold))
        rng.shuffle(chosen)
        blocks = [QA_DOCUMENT_PROMPT.format(i=i + 1, document=docs[d]) for i, d in enumerate(chosen)]
        gold_blocks = [b for b, d in zip(blocks, chosen, strict=True) if d in set(gold)]
        return Built(
            text=_T["template"].format(context="\n\n".join(blocks), query=question["query"]),
            outputs=list(question["outputs"]),
            answer_prefix=_T["answer_prefix"],
            needles=gold_blocks,
            metadata={"question": number, "query": question["query"], "num_docs": len(chosen)},
        )


@register_task("qa_1")
@dataclass
class SquadTask(QATask):
    """RULER's ``qa_1``: SQuAD."""

    dataset: str = "squad"


@register_task("qa_2")
@dataclass
class HotpotQATask(QATask):
    """RULER's ``qa_2``: HotpotQA."""

    dataset: str = "hotpotqa"
