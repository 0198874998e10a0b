"""vt, cwe, fwe, qa and the context-free task: sized with the real tokenizer, answers in place, scored."""

from __future__ import annotations

import collections
import re

import pytest

from qada.eval.tasks import TASKS, ContextFreeTask, count_tokens, score
from qada.eval.tasks.freq_words import zeta


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory

    return AutoTokenizer.from_pretrained(model_directory(None))


def tolerance(length: int) -> int:
    return max(50, int(0.03 * length))


def check_sized(tokenizer, samples, length, slack=None):
    for s in samples:
        assert s.length == count_tokens(tokenizer, s.input, s.template)
        assert length - (slack or tolerance(length)) <= s.length <= length, s.length
        assert s.input.endswith(s.answer_prefix)


def check_scores(name, samples, perfect):
    refs = [s.outputs for s in samples]
    assert score(name, [perfect(s) for s in samples], refs) == 100.0
    assert score(name, ["no idea"] * len(samples), refs) == 0.0


def test_vt(tokenizer):
    samples = TASKS.build("vt").generate(tokenizer, 2048, 2, seed=0)
    check_sized(tokenizer, samples, 2048)
    for s in samples:
        assert len(s.outputs) == 5 and s.tokens_to_generate == 30
        value = re.search(rf"VAR {s.outputs[0]} = (\d+)", s.input).group(1)
        assert f"5 variables are assgined the value {value}, they are: " in s.answer_prefix
        for a, b in zip(s.outputs, s.outputs[1:], strict=False):  # the chain, hop by hop
            assert f"VAR {b} = VAR {a} " in s.input
        assert s.input.index("they are: ") < s.input.index(f"VAR {s.outputs[0]} =")  # the solved example first
    check_scores("vt", samples, lambda s: " ".join(s.outputs))


def test_cwe(tokenizer):
    for length, common in ((1024, 6), (4096, 30)):  # RULER's short-context frequencies below 4096 tokens
        samples = TASKS.build("cwe").generate(tokenizer, length, 1, seed=0)
        check_sized(tokenizer, samples, length)
        s = samples[0]
        main = s.input.split("\n")[-2]  # the numbered list of the question (after the solved example)
        counts = collections.Counter(re.findall(r"\d+\. (\S+)", main))
        assert sorted(counts[w] for w in s.outputs) == [common] * 10
        assert max(c for w, c in counts.items() if w not in s.outputs) < common
    check_scores("cwe", samples, lambda s: ", ".join(s.outputs))


def test_fwe(tokenizer):
    assert zeta(2.0) == pytest.approx(3.141592653589793**2 / 6, rel=1e-12)
    samples = TASKS.build("fwe").generate(tokenizer, 2048, 2, seed=0)
    check_sized(tokenizer, samples, 2048)
    for s in samples:
        coded = s.input.split("Find the three most frequently appeared coded words. ")[1].split("\n")[0]
        ranked = [w for w, _ in collections.Counter(coded.split()).most_common(4)]
        assert ranked[0] == "..." and ranked[1:] == s.outputs  # the noise, then the three answers
    check_scores("fwe", samples, lambda s: " ".join(s.outputs))


@pytest.mark.parametrize("name", ["qa_1", "qa_2"])
def test_qa(tokenizer, name):
    samples = TASKS.build(name).generate(tokenizer, 2048, 2, seed=0)
    check_sized(tokenizer, samples, 2048, slack=400)  # documents are coarse units, as in RULER
    task = TASKS.build(name)
    assert task.metric == "string_match_part" and task.tokens_to_generate == 32
    for s in samples:
        assert s.metadata["question"] == s.index  # RULER: sample i asks question i
        assert s.answer_prefix == " Answer:" and f"Question: {s.metadata['query']} Answer:" in s.input
        assert all(
            s.input[a:b] == n for n, (a, b) in zip(s.metadata["needles"], s.metadata["needle_spans"], strict=True)
        )
        if name == "qa_1":  # a SQuAD answer is a span of its gold paragraph (HotpotQA has yes/no answers)
            assert any(out in " ".join(s.metadata["needles"]) for out in s.outputs)
    check_scores(name, samples, lambda s: s.outputs[-1])
    assert TASKS.build(name, first_question=5).generate(tokenizer, 2048, 1)[0].metadata["question"] == 5


@pytest.mark.parametrize("name", ["vt", "cwe", "fwe", "qa_1", "context_free"])
def test_deterministic_and_chat(tokenizer, name):
    a = TASKS.build(name).generate(tokenizer, 1536, 2, seed=4)
    assert a == TASKS.build(name).generate(tokenizer, 1536, 2, seed=4)
    assert [s.input for s in a] != [s.input for s in TASKS.build(name).generate(tokenizer, 1536, 2, seed=5)]
    chat = TASKS.build(name, template="chat").generate(tokenizer, 1536, 1, seed=4)
    assert chat[0].template == "chat" and chat[0].input.startswith("<|im_start|>system")
    check_sized(tokenizer, chat, 1536, slack=400 if name == "qa_1" else None)


@pytest.mark.parametrize("question", ["arithmetic", "knowledge"])
def test_context_free(tokenizer, question):
    samples = TASKS.build("context_free", question=question).generate(tokenizer, 2048, 3, seed=0)
    check_sized(tokenizer, samples, 2048)
    for s in samples:
        q = s.metadata["question"]
        assert s.input.endswith(f"\nQuestion: {q} Answer:")
        assert s.input.startswith("A special magic number is hidden within the following text.")
        assert len(s.metadata["needles"]) == 1 and s.metadata["needles"][0] in s.input  # a real niah context
        if question == "arithmetic":
            a, b = map(int, re.findall(r"\d+", q))
            assert s.outputs == [str(a + b)]
    check_scores("context_free", samples, lambda s: f" {s.outputs[0]}.")
    with pytest.raises(ValueError, match="niah task"):
        ContextFreeTask(context_task="vt")
