"""Every fused decode step gives the same result whatever order a launch's programs run in, and interleaved.

On a GPU a launch's programs run side by side and start and finish in no set order; Triton's interpreter runs them
one after the other in grid order. The fused kernels share memory between the programs of one launch (the moment
launch's block pairs, the last of which finishes for the others; page-top programs beside them; the split that
writes the decision or the step key's page; the combine launch's moment programs stepping the next step's moments),
so a result that holds only in grid order, or only one program at a time, would be a GPU-only bug.
:func:`~qada.attention.interpreter.program_order` runs each launch's programs reversed, shuffled or interleaved
(taking turns at each memory operation): the tokens' logits, every layer's decisions and the run's statistics must
be those of the grid order, bit for bit.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("reorders the programs of Triton's interpreter (a GPU runs its own order)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from tiny_models import tiny_model  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from qada.attention import _moment_kernel  # noqa: E402
from qada.attention.interpreter import program_order  # noqa: E402
from qada.moments.reference import collect_reference_keys  # noqa: E402
from tests.forced_decode import STEPS, decode  # noqa: E402
from tests.test_fused_decision import greedy, make_run, model, reference  # noqa: E402, F401 - the tiny model's fixtures

OWN_PROGRAM_ORDER = True
"""These tests set the order themselves (``pytest --program-order`` leaves them alone: tests/conftest.py)."""


@triton.jit
def _arrival_kernel(COUNT, OUT, NY: tl.constexpr):
    tl.store(OUT + tl.program_id(0) * NY + tl.program_id(1), tl.atomic_add(COUNT, 1))


def _arrivals(order: str, seed: int = 0, grid: tuple[int, int] = (3, 4)) -> list[int]:
    """The position at which each program of a ``grid`` launch ran, in grid order."""
    count, out = torch.zeros(1, dtype=torch.int32), torch.full(grid, -1, dtype=torch.int32)
    with program_order(order, seed=seed):
        _arrival_kernel[grid](count, out, NY=grid[1])
    return out.flatten().tolist()


def test_each_order_runs_every_program_once():
    natural, reversed_, shuffled = _arrivals("natural"), _arrivals("reversed"), _arrivals("shuffled", seed=1)
    assert natural == list(range(12)) and reversed_ == list(range(11, -1, -1))
    assert sorted(shuffled) == list(range(12)) and shuffled not in (natural, reversed_)
    assert _arrivals("shuffled", seed=1) == shuffled != _arrivals("shuffled", seed=2)  # a seed's order, repeatable
    interleaved = _arrivals("interleaved", seed=1)
    assert sorted(interleaved) == list(range(12)) and interleaved == _arrivals("interleaved", seed=1)
    with program_order("reversed"):
        assert _arrivals("natural") == natural  # nested: the innermost order holds
        assert _arrivals("shuffled", seed=1) == shuffled
        count, out = torch.zeros(1, dtype=torch.int32), torch.full((3, 4), -1, dtype=torch.int32)
        _arrival_kernel[(3, 4)](count, out, NY=4)  # and the enclosing one again after it
        assert out.flatten().tolist() == reversed_
    count, out = torch.zeros(1, dtype=torch.int32), torch.full((3, 4), -1, dtype=torch.int32)
    _arrival_kernel[(3, 4)](count, out, NY=4)  # after the context: the interpreter's own order again
    assert out.flatten().tolist() == natural
    with pytest.raises(ValueError, match="expected an order of"):
        with program_order("backwards"):
            pass


@triton.jit
def _racy_count_kernel(COUNT):
    tl.store(COUNT, tl.load(COUNT) + 1)  # a read-modify-write that is not atomic


def test_interleaved_programs_take_turns_between_memory_operations(monkeypatch):
    """In any sequential order a non-atomic count of 16 programs reaches 16; interleaved, a program may load the count
    before another stores it, as on a GPU: updates are lost. A program's error stops the launch and is raised."""
    for order in ("natural", "reversed", "shuffled"):
        count = torch.zeros(1, dtype=torch.int32)
        with program_order(order, seed=3):
            _racy_count_kernel[(16,)](count)
        assert count.item() == 16
    count = torch.zeros(1, dtype=torch.int32)
    with program_order("interleaved", seed=3):
        _racy_count_kernel[(16,)](count)
    assert 1 <= count.item() < 16
    builder = interpreter.interpreter_builder
    store = builder.create_store

    def failing_store(*args, **kwargs):
        if builder.grid_idx == (5, 0, 0):
            raise RuntimeError("program 5 failed")
        return store(*args, **kwargs)

    monkeypatch.setattr(builder, "create_store", failing_store)
    count, threads = torch.zeros(1, dtype=torch.int32), threading.active_count()
    with program_order("interleaved"), pytest.raises(Exception, match="program 5 failed"):
        _racy_count_kernel[(8,)](count)
    assert threading.active_count() == threads  # every program's thread ended


# --- the fused decode steps ----------------------------------------------------------------------------------------

FUSED = {"name": "triton_fused", "block_size": 16, "num_splits": 4}
LEAN = {"name": "qada_tail", "tau": 0.42, "attend_exact": True, "super_page": 4, "super_pages": 2, "pages": 2,
        "heavy": 8, "scale_exact": 8192, "shrink_exact": False}
CASES = {  # name: (criterion, executor, moments); each launch layout whose programs share memory once at least
    "qada": ({"name": "qada", "tau": 0.42}, FUSED, "stored"),
    "qada current": ({"name": "qada", "tau": 0.42}, FUSED, "current"),
    "qada estimating": ({"name": "qada", "tau": 0.42}, {**FUSED, "estimate_in_splits": True}, "stored"),
    "qada estimating current": ({"name": "qada", "tau": 0.42}, {**FUSED, "estimate_in_splits": True}, "current"),
    "qada once": ({"name": "qada", "tau": 0.42}, {**FUSED, "decide_once": True}, "current"),
    "qada_tail once": ({"name": "qada_tail", "tau": 0.42}, {**FUSED, "decide_once": True}, "stored"),
    "qada_tail splits spread": ({"name": "qada_tail", "tau": 0.42},
                                {**FUSED, "decide_once": False, "pages_per_program": 4}, "current"),
    "qada_tail once spread": ({"name": "qada_tail", "tau": 0.42},
                              {**FUSED, "decide_once": True, "pages_per_program": 4}, "stored"),
    "lean": (LEAN, {**FUSED, "decide_once": False}, "stored"),
    "qada_budget": ({"name": "qada_budget", "sparsity": 0.5}, FUSED, "current"),
    "qada_tail_budget group": ({"name": "qada_tail_budget", "sparsity": 0.5, "per_group": True}, FUSED, "stored"),
    "dense": ("dense", FUSED, "none"),
}  # fmt: skip


@pytest.fixture(scope="module")
def model_and_prompt(tmp_path_factory):
    """A tiny Llama with SmolLM2's head size (64: three block pairs of moment state per KV head) and three query
    heads per KV head, a 300-token prompt (19 pages of 16) and a stored reference of 420 keys."""
    lm = tiny_model("llama", num_hidden_layers=2, hidden_size=192, head_dim=64, num_attention_heads=6,
                    num_key_value_heads=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, lm.config.vocab_size, (1, 300), generator=g)
    ref = tmp_path_factory.mktemp("order") / "ref.safetensors"
    collect_reference_keys(lm, torch.randint(3, lm.config.vocab_size, (1, 420), generator=g),
                           info={"prompt": "random_words"}).save(ref)
    return lm, ids, str(ref)


def assert_same_decode(got, expected, what: str) -> None:
    logits, decisions, summary = got
    assert torch.equal(logits, expected[0]), f"{what}: logits differ by {(logits - expected[0]).abs().max():.3g}"
    assert decisions.keys() == expected[1].keys(), what
    for key, local in decisions.items():
        assert torch.equal(local, expected[1][key]), f"{what}: decisions of layer {key[0]} at step {key[1]}"
    assert summary == expected[2], what


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_fused_decode_is_the_same_in_every_program_order(model_and_prompt, case):
    lm, ids, ref = model_and_prompt
    criterion, executor, moments = CASES[case]
    expected = decode(lm, ids, ref, criterion, executor, moments)
    assert len(expected[1]) == 2 * len(STEPS)
    for order, seed in (("reversed", 0), ("interleaved", 1)):
        with program_order(order, seed=seed):
            assert_same_decode(decode(lm, ids, ref, criterion, executor, moments), expected,
                               f"{case}, {order}")


ROWS_CASES = {  # two rows, the second left-padded (the tiny model of tests/test_fused_decision.py: d = 16)
    "qada": ("stored", {"name": "qada", "tau": 0.3}, {"name": "triton_fused", "block_size": 16, "num_splits": 2}),
    "qada estimating": ("current", {"name": "qada", "tau": 0.3},
                        {"name": "triton_fused", "block_size": 16, "num_splits": 2, "estimate_in_splits": True}),
    "qada_tail once spread": ("stored", {"name": "qada_tail", "tau": 0.3, "page_size": 4},
                              {"name": "triton_fused", "block_size": 16, "num_splits": 2, "decide_once": True,
                               "pages_per_program": 2}),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ROWS_CASES))
def test_rows_with_left_padding_decode_the_same_interleaved(model, reference, case):  # noqa: F811
    """Two rows of different lengths (each row's own bounds in every program): the same greedy tokens and statistics
    with each launch's programs interleaved as in grid order."""
    source, criterion, executor = ROWS_CASES[case]
    expected = greedy(model, make_run(source, executor, reference, criterion), "static")
    with program_order("interleaved", seed=4):
        tokens, summary = greedy(model, make_run(source, executor, reference, criterion), "static")
    assert torch.equal(tokens, expected[0]) and summary == expected[1]
    assert 0 < summary["sparsity"] < 1


@triton.jit
def _last_by_number(ARRIVED, pair, BP: tl.constexpr):
    """A wrong :func:`~qada.attention._moment_kernel.last_to_arrive`: the pair's last block pair taken as the last
    program to finish (true in the interpreter's grid order, not on a GPU)."""
    return tl.program_id(1) == BP - 1


@triton.jit
def _last_by_plain_count(ARRIVED, pair, BP: tl.constexpr):
    """Another wrong :func:`~qada.attention._moment_kernel.last_to_arrive`: the arrivals counted by a load and a store
    instead of an atomic addition (right in any order of whole programs, not when they run side by side)."""
    arrived = tl.load(ARRIVED + pair)
    tl.store(ARRIVED + pair, arrived + 1)
    last = arrived == BP - 1
    if last:
        tl.store(ARRIVED + pair, 0)
    return last


def test_kernels_that_hold_only_in_grid_order_or_one_at_a_time_are_caught(model_and_prompt, monkeypatch):
    """Not vacuous: with the moment launch's last program chosen by its number instead of by an atomic count, the
    decode is right in grid order (the real kernel's, bit for bit) and wrong reversed (the finishing program reads
    block pairs' shares not yet written); with the arrivals counted without an atomic, it is right in every order of
    whole programs and wrong interleaved (two programs read the same count: none, or two, finish)."""
    lm, ids, ref = model_and_prompt
    criterion, executor, moments = CASES["qada current"]
    expected = decode(lm, ids, ref, criterion, executor, moments)
    with monkeypatch.context() as patched:
        patched.setattr(_moment_kernel, "last_to_arrive", _last_by_number)
        assert_same_decode(decode(lm, ids, ref, criterion, executor, moments), expected, "grid order")
        with program_order("reversed"), pytest.raises(AssertionError):
            assert_same_decode(decode(lm, ids, ref, criterion, executor, moments), expected, "reversed")
    monkeypatch.setattr(_moment_kernel, "last_to_arrive", _last_by_plain_count)
    with program_order("reversed"):
        assert_same_decode(decode(lm, ids, ref, criterion, executor, moments), expected, "reversed")
    with program_order("interleaved", seed=1), pytest.raises(AssertionError):
        assert_same_decode(decode(lm, ids, ref, criterion, executor, moments), expected, "interleaved")
