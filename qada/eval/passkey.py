"""Pass-key retrieval prompts (completion style): a number hidden at a chosen depth in real essay text."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PasskeyPrompt", "passkey_prompt"]

_INSTRUCTION = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
_QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass
class PasskeyPrompt:
    """A pass-key prompt: ``input_ids [1, T]``, the key, and the token index where the needle starts."""

    input_ids: torch.Tensor
    key: str
    needle_position: int

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def passkey_prompt(tokenizer: Any, length: int, depth: float = 0.5, seed: int = 0) -> PasskeyPrompt:
    """A prompt of exactly ``length`` tokens (± the needle's tokenisation) with a 5-digit key at ``depth``.

    Args:
        tokenizer: the model's tokenizer.
        length: target prompt length in tokens.
        depth: needle position as a fraction of the haystack, in ``[0, 1]``.
        seed: chooses the key and the essay offset.
    """
    from qada.moments.prompts import corpus_text

    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"expected depth in [0, 1] but got {depth}")
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    fixed = len(encode(_INSTRUCTION)) + len(encode(needle)) + len(encode(_QUESTION))
    budget = length - fixed
    if budget < 1:
        raise ValueError(f"expected a length above {fixed} tokens for a pass-key prompt but got {length}")
    text = corpus_text()
    offset = rng.randrange(0, max(1, len(text) // 2))
    haystack = encode(text[offset : offset + 8 * budget + 1000])
    while len(haystack) < budget:
        haystack = haystack + encode(text[: 8 * budget])
    haystack = haystack[:budget]
    cut = int(round(depth * budget))
    ids = encode(_INSTRUCTION) + haystack[:cut]
    needle_position = len(ids)
    ids = ids + encode(needle) + haystack[cut:] + encode(_QUESTION)
    return PasskeyPrompt(torch.tensor([ids]), key, needle_position)
