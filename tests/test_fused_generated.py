"""The fused kernels on generated cases (Hypothesis): shapes, windows, left padding, rows that end early, dtypes and
executor settings that the hand-picked cases of ``test_fused_decision``, ``test_fused_tail``, ``test_fused_budget``,
``test_fused_qada_budget`` and ``test_moment_step_kernel`` do not name, each against the same eager reference as
there. On CPU the kernels run in Triton's interpreter, so the sizes stay small and the examples few (derandomized:
the same cases every run). ``QADA_GENERATED_EXAMPLES=300`` draws that many new ones per test (add
``--program-order interleaved`` to run each launch's programs interleaved); a failing case is printed whole, not
shrunk (shrinking through the interpreter takes many minutes)."""

from __future__ import annotations

import os
import warnings

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qada.attention import FusedTritonExecutor  # noqa: E402
from qada.attention.moment_step import estimate_launch  # noqa: E402
from qada.models.fused_step import fused_moment_step  # noqa: E402
from qada.moments import CurrentMoments, StoredMoments  # noqa: E402
from qada.moments.reference import ReferenceKeys  # noqa: E402
from qada.window import Window  # noqa: E402
from tests import test_fused_budget as tail_budget  # noqa: E402
from tests import test_fused_qada_budget as qada_budget  # noqa: E402
from tests.test_attention_triton import DEVICE  # noqa: E402
from tests.test_fused_decision import check_fused, eager, fresh, make_step  # noqa: E402
from tests.test_fused_tail import assert_same_state, check_tail, eager_tail, prepared  # noqa: E402

EXAMPLES = int(os.environ.get("QADA_GENERATED_EXAMPLES", "0"))
GENERATED = settings(max_examples=EXAMPLES or 8, derandomize=not EXAMPLES, deadline=None,
                     suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.reuse, Phase.generate])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ONLY_DIMS = tuple(int(d) for d in os.environ.get("QADA_GENERATED_HEAD_DIMS", "").split(",") if d)
HEAD_DIMS = ONLY_DIMS or (16, 32, 64, 80, 96, 128, 256)
"""The head dims of the drawn decode steps: powers of two up to Gemma's 256, and Phi-2's 80 and Phi-3's 96 (the
kernels pad them to a power of two). ``QADA_GENERATED_HEAD_DIMS=256`` draws only those given, in the moment steps
too."""
MOMENT_DIMS = ONLY_DIMS or (8, 16, 24, 40, 64, 72, 128, 256)


def longest(d: int) -> int:
    """The most slots drawn at head dim ``d`` (the interpreter's time grows with it)."""
    return 700 if d <= 64 else 300 if d <= 128 else 200


@st.composite
def decode_steps(draw, max_kv=3, groups=(1, 2, 3, 4), min_length=2, max_length=700, dtypes=DTYPES):
    """A :func:`~tests.test_fused_decision.make_step` step of drawn shapes: ``b`` rows (left padding and early ends
    or none), ``H_kv`` KV heads of ``G`` query heads each, ``C`` slots (:func:`longest`), a head dim of
    :data:`HEAD_DIMS`, a window of any ``t_local`` and ``t_sink <= t_local``, a soft cap and sink logits or not."""
    b, H_kv, G = draw(st.integers(1, 3)), draw(st.integers(1, max_kv)), draw(st.sampled_from(groups))
    d = draw(st.sampled_from(HEAD_DIMS))
    C = draw(st.integers(min_length, min(max_length, longest(d))))
    t_local = draw(st.integers(2, 64))
    window = Window(t_local, draw(st.integers(0, t_local - 1)))
    starts = draw(st.one_of(st.none(), st.lists(st.integers(0, C - 1), min_size=b, max_size=b)))
    ends = draw(st.one_of(st.none(), st.tuples(*(st.integers(first + 1, C) for first in starts or [0] * b))))
    dtype, softcap, sinks = draw(st.sampled_from(dtypes)), draw(st.sampled_from([None, 3.0])), draw(st.booleans())
    return make_step(b, H_kv * G, H_kv, C, d, starts, None if ends is None else list(ends), dtype, seed=C,
                     softcap=softcap, sinks=sinks, window=window)


def tau_among(ratio: torch.Tensor, has_bulk: torch.Tensor, data) -> float:
    """A threshold halfway between two drawn neighbouring ratios of the heads with a bulk (the checks let the heads
    within rounding of it go either way), or one of three where fewer than two heads have a bulk."""
    values = ratio[has_bulk].flatten().double().sort().values.tolist()
    if len(values) < 2:
        return data.draw(st.sampled_from([0.1, 0.5, 0.9]), "tau")
    i = data.draw(st.integers(0, len(values) - 2), "between")
    return min(1.0, max(0.0, (values[i] + values[i + 1]) / 2))


@GENERATED
@given(step=decode_steps(), policy=st.sampled_from(["exact", "promote"]), block=st.sampled_from([16, 32, 64]),
       splits=st.integers(1, 7), mode=st.sampled_from(["in splits", "once", "estimating"]), data=st.data())
def test_generated_qada_steps_equal_eager(step, policy, block, splits, mode, data):
    """``qada`` (eqs. 5-7) decided in the splits, once per group, or with the estimate in the splits: the eager
    decisions and fail-safe count, the statistics row, the unfused and reference outputs, the blocks read
    (:func:`~tests.test_fused_decision.check_fused`)."""
    _, _, _, _, ratio = eager(step, 0.5, policy)
    tau = tau_among(ratio, fresh(step).has_bulk, data)
    check_fused(step, tau, policy, block, splits, decide_once=mode == "once", estimate_in_splits=mode == "estimating")


@GENERATED
@given(step=decode_steps(max_kv=2, groups=(1, 2, 3), min_length=8, max_length=600),
       policy=st.sampled_from(["exact", "promote"]), block=st.sampled_from([16, 32, 64]), splits=st.integers(1, 5),
       heavy=st.sampled_from([0, 4, 8, 16]), observe=st.sampled_from([2, 4, 8]), page_size=st.sampled_from([4, 8, 16]),
       pages=st.integers(1, 5), attend_exact=st.booleans(), hierarchy=st.booleans(),
       mode=st.sampled_from(["in splits", "once", "heads apart"]), pages_per_program=st.sampled_from([256, 2, 5]),
       data=st.data())
def test_generated_qada_tail_steps_equal_eager(step, policy, block, splits, heavy, observe, page_size, pages,
                                               attend_exact, hierarchy, mode, pages_per_program, data):
    """``qada_tail`` (the heavy set, the page bounds and their top pages, eq. 7 on the rest), with or without a page
    hierarchy and ``attend_exact``, prefilled on all slots but the last or on fewer; decided in the splits, once, or
    one program per query head; page bounds in one program or spread: the eager decisions, state after the step,
    statistics, output and blocks read (:func:`~tests.test_fused_tail.check_tail`)."""
    sizes = dict(heavy=heavy, observe=observe, page_size=page_size, pages=pages, attend_exact=attend_exact)
    if hierarchy:
        sizes.update(super_page=data.draw(st.integers(2, 4), "super_page"),
                     super_pages=data.draw(st.integers(1, 3), "super_pages"))
    C = step.length
    filled = data.draw(st.one_of(st.none(), st.integers(1, C - 1)), "filled")
    criterion, state = prepared(step, C, filled=filled, **sizes)
    *_, ratio, _, eager_step = eager_tail(criterion, step, state, 0.5, policy)
    tau = tau_among(ratio, eager_step.has_bulk, data)
    options = {"heads_apart": True} if mode == "heads apart" else {}
    check_tail(criterion, step, state, tau, policy, block, splits, decide_once=mode != "in splits",
               pages_per_program=pages_per_program, exact_matters=False, **options)


@GENERATED
@given(step=decode_steps(max_kv=4, min_length=8, max_length=600, dtypes=DTYPES[:2]),
       policy=st.sampled_from(["exact", "promote"]), sparsity=st.floats(0.05, 0.95), per_group=st.booleans(),
       tail=st.booleans(), heavy=st.sampled_from([0, 4, 8]), page_size=st.sampled_from([4, 8, 16]),
       pages=st.integers(1, 4), pages_per_program=st.sampled_from([256, 3]),
       heads_apart=st.sampled_from([None, True, False]))
def test_generated_budget_steps_equal_eager(step, policy, sparsity, per_group, tail, heavy, page_size, pages,
                                            pages_per_program, heads_apart):
    """``qada_budget`` and ``qada_tail_budget`` (per head or per group, the score launch per query head or per
    group): the eager scores and (without near ties) decisions, the tail index after the step, the statistics row,
    the unfused output, and every row with a bulk and no head forced dense keeping exactly its count local."""
    G = step.num_heads // step.num_kv_heads
    if tail:
        criterion, state = tail_budget.prepared(step, step.length, sparsity, per_group, heavy=heavy, observe=4,
                                                page_size=page_size, pages=pages)
        decided, local, read, fail_safe, score, state_after, eager_step = tail_budget.eager(criterion, step, state,
                                                                                            policy)
        got, got_state = tail_budget.fused(criterion, step, state, policy, pages_per_program=pages_per_program,
                                           heads_apart=heads_apart)
        names = tail_budget.STATE
        assert_same_state({n: got_state[n] for n in names}, {n: state_after[n] for n in names})
    else:
        criterion, state = qada_budget.prepared(step, sparsity, per_group)
        decided, local, read, fail_safe, score, eager_step = qada_budget.eager(criterion, step, state, policy)
        got = qada_budget.fused(criterion, step, state, policy)
    tail_budget.check_budget(got, (decided, local, read, fail_safe, score), eager_step, criterion, step, policy,
                             int(qada_budget.count_of(criterion, state, G)), per_group, drawn=True)


@GENERATED
@given(kind=st.sampled_from(["current", "stored"]), b=st.integers(1, 3), H_kv=st.integers(1, 3),
       d=st.sampled_from(MOMENT_DIMS), t_local=st.integers(1, 24), T=st.integers(1, 60),
       steps=st.integers(1, 8), spread=st.booleans(), G=st.sampled_from([0, 1, 3, 8]),
       softcap=st.sampled_from([None, 3.0]), data=st.data())
def test_generated_moment_steps_equal_the_sources(kind, b, H_kv, d, t_local, T, steps, spread, G, softcap, data):
    """The moment step's launch (one program per block pair of the state, or per (row, KV head)), with each query
    head's ``log E[exp(s)]`` or without: after every step the source's torch step's float64 state and float32
    moments, and (in the interpreter) bit for bit the estimate's own launch on them. Head dims not a power of two,
    short prompts, rows with left padding, a stored reference's range that jumps (its offset and short-prompt rule
    drawn). At head dim 256 (Gemma's) one row, at most two KV heads and three steps: the interpreter's time grows with
    the state's d^2."""
    if d >= 256:
        b, H_kv, steps = 1, min(H_kv, 2), min(steps, 3)
    window = Window(t_local, data.draw(st.integers(0, t_local - 1), "t_sink"))
    capacity = T + steps + data.draw(st.integers(0, 5), "spare")
    starts = data.draw(st.one_of(st.none(), st.lists(st.integers(0, T - 1), min_size=b, max_size=b)), "starts")
    g = torch.Generator().manual_seed(T * 7 + d)
    keys = torch.randn(b, H_kv, capacity, d, generator=g) * 2 + 1
    if kind == "current":
        moments = CurrentMoments()
    else:
        moments = StoredMoments(offset=data.draw(st.integers(0, 20), "offset"),
                                min_bulk_keys=data.draw(st.integers(1, 8), "min_bulk_keys"))
        length = window.t_sink + data.draw(st.integers(1, 90), "bulk keys")  # (a shorter one is an error)
        moments.set_reference(ReferenceKeys(torch.randn(1, H_kv, length, d, generator=g) + 0.5))
    start = None if starts is None else torch.tensor(starts)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "the reference .* is shorter", UserWarning)  # (a short one says so)
        moments.prefill(0, keys[:, :, :T], start, window, capacity=capacity)
    state = moments.step_state(0)
    torch_state, kernel_state = ({n: (t.clone() if n not in ("ref", "shift") else t).to(DEVICE) for n, t in
                                  state.items()} for _ in range(2))
    query = torch.randn(b, H_kv * G, d, generator=g).to(DEVICE) * 2 if G else None
    keys, start = keys.to(DEVICE), None if start is None else start.to(DEVICE)
    for end in range(T + 1, T + 1 + steps):
        ends = torch.full((b,), end, device=DEVICE)
        expected = moments.step(torch_state, keys, start, ends, window)
        estimate = None if query is None else FusedTritonExecutor(spread_moments=spread).bulk_estimate(
            query, 0.25, softcap)
        got = fused_moment_step(moments, kernel_state, keys, start, ends, window, estimate)
        for name in torch_state:
            torch.testing.assert_close(kernel_state[name], torch_state[name], rtol=1e-10, atol=1e-10,
                                       msg=f"{name} at {end}")
        torch.testing.assert_close(got.mean, expected.mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.cov, expected.cov, rtol=1e-5, atol=1e-5)
        if estimate is not None and DEVICE.type == "cpu":
            again = FusedTritonExecutor().bulk_estimate(query, 0.25, softcap)
            assert torch.equal(estimate_launch(again, got), estimate.out)
