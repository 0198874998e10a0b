"""niah variants: sized to the target with the real SmolLM2 tokenizer, needles in place, scored like RULER."""

from __future__ import annotations

import time

import pytest

from qada.eval.tasks import TASKS, NiahTask, count_tokens, score

NIAH = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory

    return AutoTokenizer.from_pretrained(model_directory(None))


def tolerance(length: int) -> int:
    return max(50, int(0.03 * length))


@pytest.mark.parametrize("name", NIAH)
def test_niah_sized_with_needles_and_scored(tokenizer, name):
    length = 2048
    samples = TASKS.build(name).generate(tokenizer, length, num_samples=2, seed=3)
    assert [s.index for s in samples] == [0, 1]
    task = TASKS.build(name)
    for s in samples:
        assert s.task == name and s.template == "base" and s.tokens_to_generate == 128
        assert length - tolerance(length) <= s.length <= length
        assert s.length == count_tokens(tokenizer, s.input)
        assert s.input.endswith(s.answer_prefix) and s.answer_prefix.startswith(" The special magic")
        needles = s.metadata["needles"]
        assert len(needles) == task.num_keys * task.num_needle_v
        assert len(s.outputs) == task.num_needle_q * task.num_needle_v
        for out in s.outputs:  # every answer is the value of a needle hidden in the prompt
            assert out in s.input.removesuffix(s.answer_prefix)
            assert any(n.endswith(f" is: {out}.") for n in needles)
        for needle, (start, end), token in zip(
            needles, s.metadata["needle_spans"], s.metadata["needle_token_positions"], strict=True
        ):
            assert s.input[start:end] == needle
            decoded = tokenizer.decode(tokenizer(s.input)["input_ids"][token : token + 4])
            assert decoded.strip().startswith("One of")
        for query in s.metadata["queries"]:
            assert query in s.answer_prefix
    refs = [s.outputs for s in samples]
    assert score(name, [" " + ", ".join(s.outputs) + "." for s in samples], refs) == 100.0
    assert score(name, ["I do not know.", "0000000"], refs) == 0.0


def test_singular_and_plural_wording(tokenizer):
    single = TASKS.build("niah_single_2").generate(tokenizer, 600, 1, seed=0)[0]
    assert single.input.startswith("A special magic number is hidden within the following text.")
    assert single.answer_prefix.endswith("mentioned in the provided text is")
    multi = TASKS.build("niah_multivalue").generate(tokenizer, 600, 1, seed=0)[0]
    assert multi.input.startswith("Some special magic numbers are hidden within the following text.")
    assert multi.answer_prefix.endswith("mentioned in the provided text are")
    query = TASKS.build("niah_multiquery").generate(tokenizer, 600, 1, seed=0)[0]
    assert query.answer_prefix.count(", ") == 3 and ", and " in query.answer_prefix


def test_deterministic_given_seed(tokenizer):
    task = TASKS.build("niah_single_3")
    a = task.generate(tokenizer, 1024, 3, seed=7)
    b = TASKS.build("niah_single_3").generate(tokenizer, 1024, 3, seed=7)
    c = task.generate(tokenizer, 1024, 3, seed=8)
    assert a == b
    assert [s.input for s in a] != [s.input for s in c]
    assert len({s.outputs[0] for s in a}) == 3  # samples differ from each other


def test_chat_template_recorded(tokenizer):
    s = TASKS.build("niah_single_1", template="chat").generate(tokenizer, 1024, 1, seed=0)[0]
    assert s.template == "chat"
    assert s.input.startswith("<|im_start|>") and s.input.endswith("<|im_start|>assistant\n" + s.answer_prefix)
    assert 1024 - tolerance(1024) <= s.length <= 1024
    assert s.length == count_tokens(tokenizer, s.input, "chat")


def test_four_k_is_fast(tokenizer):
    TASKS.build("niah_single_2").generate(tokenizer, 256, 1)  # warm the essay cache
    start = time.perf_counter()
    samples = TASKS.build("niah_single_2").generate(tokenizer, 4096, 10, seed=0)
    assert time.perf_counter() - start < 10.0
    assert all(4096 - tolerance(4096) <= s.length <= 4096 for s in samples)


def test_bad_configs_and_lengths(tokenizer):
    with pytest.raises(ValueError, match="type_haystack"):
        NiahTask(type_haystack="grass")
    with pytest.raises(ValueError, match="num_needle_v"):
        NiahTask(num_needle_v=0)
    with pytest.raises(ValueError, match="template"):
        NiahTask(template="dialog")
    with pytest.raises(ValueError, match="longer prompt"):
        TASKS.build("niah_single_1").generate(tokenizer, 20, 1)
    with pytest.raises(ValueError, match="unknown task"):
        TASKS.build("niah_single_9")
