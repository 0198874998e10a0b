"""Common words extraction (``cwe``), RULER's ``common_words_extraction.py``.

A numbered list of words in which ``num_cw`` words appear ``freq_cw`` times and the others ``freq_ucw``
times; the answer is the common words. As in RULER, a solved example comes first, and prompts shorter than
4096 tokens use the short-context frequencies (example 3/1, main 6/1). ``size`` counts distinct words.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from qada.eval.tasks.base import Built, Task, register_task
from qada.eval.tasks.data import cwe_words
from qada.eval.tasks.templates import TASK_TEMPLATES

__all__ = ["CommonWordsTask"]

_T = TASK_TEMPLATES["common_words_extraction"]


@functools.lru_cache(maxsize=8)
def _vocabulary(seed: int) -> tuple[str, ...]:
    words = list(cwe_words())
    random.Random(seed).shuffle(words)  # RULER: random.Random(args.random_seed).shuffle(words)
    return tuple(words)


def _enumerate(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


@dataclass
class CommonWordsTask(Task):
    """RULER's cwe; ``freq_cw``/``freq_ucw`` apply from 4096 tokens on (shorter prompts use 6/1)."""

    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    template: str = "base"

    tokens_to_generate = _T["tokens_to_generate"]

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("freq_cw", "freq_ucw", "num_cw"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} >= 1 but got {value!r}")

    def size_range(self, length: int) -> tuple[int, int]:
        return self.num_cw, len(cwe_words())

    def _list(self, rng: random.Random, words: tuple[str, ...], num_words: int, common: int, uncommon: int):
        chosen = rng.sample(words, num_words)
        frequent, rare = chosen[: self.num_cw], chosen[self.num_cw :]
        items = frequent * common + rare * uncommon
        rng.shuffle(items)
        return _enumerate(items), frequent

    def build(self, rng: random.Random, size: int, length: int, index: int = 0) -> Built:
        words = _vocabulary(getattr(self, "_seed", 0))
        if length < 4096:
            example, example_answer = self._list(rng, words, 20, 3, 1)
            context, answer = self._list(rng, words, size, 6, 1)
        else:
            example, example_answer = self._list(rng, words, 40, 10, 3)
            context, answer = self._list(rng, words, size, self.freq_cw, self.freq_ucw)
        solved = _T["template"].format(context=example, query="") + _T["answer_prefix"] + _enumerate(example_answer)
        text = solved + "\n" + _T["template"].format(context=context, query="")
        return Built(text=text, outputs=answer, answer_prefix=_T["answer_prefix"], metadata={"example": example_answer})

    def prepare(self, tokenizer, length: int, seed: int) -> None:
        self._seed = seed


register_task("cwe")(CommonWordsTask)
