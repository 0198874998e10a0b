"""Frequent words extraction (``fwe``), RULER's ``freq_words_extraction.py``.

Random 6-letter "coded" words with Zipf-distributed counts (rank ``k`` appears ``int(n k^-alpha / zeta(alpha))``
times); the most frequent is replaced by the noise ``...``, the answer is the next three. The vocabulary has
``length // 50`` words unless ``vocab_size`` is set. ``size`` is ``n``, about the number of words.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass

from qada.eval.tasks.base import Built, Task, register_task
from qada.eval.tasks.templates import TASK_TEMPLATES

__all__ = ["FreqWordsTask", "zeta"]

_T = TASK_TEMPLATES["freq_words_extraction"]


def zeta(s: float, terms: int = 64) -> float:
    """Riemann zeta for ``s > 1`` (Euler-Maclaurin; the role of ``scipy.special.zeta`` in RULER)."""
    if not s > 1:
        raise ValueError(f"expected zeta's argument above 1 but got {s}")
    n = float(terms)
    head = math.fsum(k**-s for k in range(1, terms))
    tail = n ** (1 - s) / (s - 1) + n**-s / 2 + s * n ** (-s - 1) / 12 - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720
    return head + tail


@dataclass
class FreqWordsTask(Task):
    """RULER's fwe with Zipf exponent ``alpha``; ``vocab_size=-1`` means ``length // 50``."""

    alpha: float = 2.0
    coded_wordlen: int = 6
    vocab_size: int = -1
    template: str = "base"

    tokens_to_generate = _T["tokens_to_generate"]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.alpha > 1:
            raise ValueError(f"expected alpha > 1 but got {self.alpha!r}")
        if self.coded_wordlen < 1:
            raise ValueError(f"expected coded_wordlen >= 1 but got {self.coded_wordlen!r}")
        if self.vocab_size != -1 and self.vocab_size < 5:
            raise ValueError(f"expected vocab_size -1 or >= 5 but got {self.vocab_size!r}")

    def size_range(self, length: int) -> tuple[int, int]:
        return 100, 4 * length + 100

    def build(self, rng: random.Random, size: int, length: int, index: int = 0) -> Built:
        vocab_size = max(5, length // 50) if self.vocab_size == -1 else self.vocab_size
        letters = string.ascii_lowercase
        vocab = ["".join(rng.choices(letters, k=self.coded_wordlen)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(rng.choices(letters, k=self.coded_wordlen)))
        vocab = sorted(set(vocab))
        rng.shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise
        z = zeta(self.alpha)
        words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(size * k**-self.alpha / z))]
        rng.shuffle(words)
        return Built(
            text=_T["template"].format(context=" ".join(words), query=""),
            outputs=vocab[1:4],
            answer_prefix=_T["answer_prefix"],
        )


register_task("fwe")(FreqWordsTask)
