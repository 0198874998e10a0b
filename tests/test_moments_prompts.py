"""Reference prompt builders over the Paul Graham essays (with a fake word-level tokenizer: no downloads)."""

from __future__ import annotations

import pytest
import torch

from qada.moments.prompts import (
    PROMPT_BUILDERS,
    build_reference_prompt,
    corpus_path,
    corpus_text,
    corpus_vocabulary,
)


class WordTokenizer:
    """Splits on whitespace; each distinct word gets the next id (a BOS id 0 first), like a tiny vocabulary."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<s>": 0}
        self.inverse = ["<s>"]

    def encode(self, text: str) -> list[int]:
        ids = [0]
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.inverse)
                self.inverse.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids) -> list[str]:
        return [self.inverse[i] for i in ids]


def test_corpus_is_found_in_the_package():
    assert corpus_path().name == "PaulGrahamEssays.json"
    vocabulary = corpus_vocabulary()
    assert len(vocabulary) > 10_000 and "essay" in vocabulary


@pytest.mark.parametrize("kind", sorted(PROMPT_BUILDERS))
@pytest.mark.parametrize("length", [1, 37, 1500])
def test_builders_exact_length_and_deterministic(kind, length):
    tok = WordTokenizer()
    a = build_reference_prompt(kind, tok, length, seed=3)
    b = build_reference_prompt(kind, tok, length, seed=3)
    assert a.dtype == torch.long and a.shape == (length,)
    assert torch.equal(a, b)
    assert a[0] == 0  # the tokenizer's own special tokens stay at the start


def test_builders_differ_by_kind_and_seed():
    tok = WordTokenizer()
    words = tok.decode(build_reference_prompt("random_words", tok, 400, 0).tolist())[1:]
    text = tok.decode(build_reference_prompt("text", tok, 400, 0).tolist())[1:]
    single = tok.decode(build_reference_prompt("single_word", tok, 400, 0).tolist())[1:]
    assert words != text
    assert len(set(single)) == 1 and len(set(words)) > 300  # independent draws from a large vocabulary
    vocabulary = set(corpus_vocabulary())
    assert all(w in vocabulary for w in words)
    assert " ".join(text[:200]) in " ".join(corpus_text().split())  # a contiguous passage of the essays
    other = build_reference_prompt("random_words", tok, 400, 1)
    assert not torch.equal(other, build_reference_prompt("random_words", tok, 400, 0))
    assert not torch.equal(build_reference_prompt("text", tok, 400, 1), build_reference_prompt("text", tok, 400, 0))


def test_longer_prompt_extends_shorter_one():
    tok = WordTokenizer()
    short = build_reference_prompt("random_words", tok, 100, 5)
    long = build_reference_prompt("random_words", tok, 1000, 5)
    assert torch.equal(long[:100], short)


def test_bad_arguments():
    tok = WordTokenizer()
    with pytest.raises(ValueError, match="expected a reference prompt"):
        build_reference_prompt("poetry", tok, 10)
    with pytest.raises(ValueError, match="length"):
        build_reference_prompt("text", tok, 0)
