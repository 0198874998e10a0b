"""RULER scoring: hand-made cases and agreement with the functions RULER's package ships."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qada.eval.tasks import (
    postprocess_pred,
    score,
    string_match_all,
    string_match_all_per_sample,
    string_match_part,
    string_match_part_per_sample,
)

ruler = importlib.import_module("long_context_eval.eval.synthetic.constants")


def test_string_match_all_hand_made():
    refs = [["1234567", "7654321"], ["apple"]]
    assert string_match_all(["1234567 and 7654321", "APPLE pie"], refs) == 100.0
    assert string_match_all(["only 1234567", "banana"], refs) == 25.0  # (1/2 + 0) / 2
    assert string_match_all(["nothing", "nothing"], refs) == 0.0
    assert string_match_all_per_sample(["only 1234567", "Apple"], refs) == [50.0, 100.0]
    # a third of three references, rounded to 2 decimals
    assert string_match_all(["a"], [["a", "b", "c"]]) == 33.33


def test_string_match_part_hand_made():
    refs = [["Paris", "paris, France"], ["Denver Broncos"]]
    assert string_match_part(["It is PARIS.", "the denver broncos won"], refs) == 100.0
    assert string_match_part(["Lyon", "Denver Broncos"], refs) == 50.0
    assert string_match_part_per_sample(["Lyon", "Broncos"], refs) == [0.0, 0.0]  # a substring of the ref is not a hit


def test_postprocess_like_ruler():
    assert postprocess_pred(None) == ""
    assert postprocess_pred("  42\x00x\t ") == "42\nx"
    assert score("qa_1", ["\n Paris\x01"], [["paris"]]) == 100.0
    assert score("niah_single_1", ["7", None], [["7"], ["8"]]) == 50.0
    assert score("qa_custom", ["b"], [["a", "b"]]) == 100.0  # unknown qa* names: string_match_part
    assert score("custom", ["b"], [["a", "b"]]) == 50.0


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match="as many"):
        string_match_all(["a"], [["a"], ["b"]])
    with pytest.raises(ValueError, match="non-empty list"):
        string_match_part(["a"], ["a"])


words = st.text(alphabet="abAB 1", max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(words, st.lists(words, min_size=1, max_size=4)), min_size=1, max_size=5))
def test_scores_equal_rulers_functions(cases):
    preds = [p for p, _ in cases]
    refs = [r for _, r in cases]
    assert string_match_all(preds, refs) == ruler.string_match_all(preds, refs)
    assert string_match_part(preds, refs) == ruler.string_match_part(preds, refs)
    assert string_match_all_per_sample(preds, refs) == ruler.string_match_all_per_sample(preds, refs)
    assert string_match_part_per_sample(preds, refs) == ruler.string_match_part_per_sample(preds, refs)
