"""A ``qada_tail`` decision launched apart (``decide_once``) with one program per query head (``heads_apart``): each
program decides its own head, and the ``triton`` split launch after it applies the group policy
(``HeadsDecided``, the split kernel's ``POLICY`` mode). Against the eager criterion, and bit for bit against one
program per KV group; the policy in the split for any decisions (Hypothesis); the launches; bad inputs. On CPU the
kernels run in Triton's interpreter (small shapes); the policy split's sm_90 compile is checked beside the ranking
split's (``tests/test_fused_budget.py``)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qada.attention import FusedTritonExecutor, TritonExecutor, apply_group_policy  # noqa: E402
from qada.attention.base import GroupDecision  # noqa: E402
from qada.attention.fused import FusedTail  # noqa: E402
from qada.attention.triton_decode import BudgetRank, HeadsDecided  # noqa: E402
from tests.test_attention_triton import DEVICE, TOLERANCE  # noqa: E402
from tests.test_fused_decision import fresh, make_step  # noqa: E402
from tests.test_fused_tail import (  # noqa: E402
    CASES,
    LEAN,
    STATE,
    assert_same_state,
    check_tail,
    fused_tail_launch,
    lean_id,
    prepared,
    tail_tau,
)

FLAGS = ("decided", "local", "read", "broken", "counts", "n_exact", "log_ratio", "bulk_blocks", "row")


def case_id(case):
    return f"C{case[3]}-{str(case[7])[6:]}-{case[10]}-{case[13]}"


def apart_and_together(case, pages_per_program=256):
    """The case's step decided with one program per query head (checked against the eager criterion) and with one
    per KV group: ``((apart, its state after), (together, its state after))``."""
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, **sizes)
    tau = tail_tau(criterion, step, state, H // H_kv, policy)
    apart, _, apart_state = check_tail(criterion, step, state, tau, policy, block, splits, decide_once=True,
                                       pages_per_program=pages_per_program, heads_apart=True)
    together = fused_tail_launch(criterion, step, state, tau, policy, block, splits, decide_once=True,
                                 pages_per_program=pages_per_program, heads_apart=False)
    return (apart, apart_state), together


LAUNCHES = [(case, 256) for case in CASES + LEAN] + [(CASES[0], 5), (CASES[2], 5)]


@pytest.mark.parametrize(("case", "pages_per_program"), LAUNCHES,
                         ids=[case_id(c) for c in CASES] + [lean_id(c) for c in LEAN] + ["defaults-spread",
                                                                                          "bf16-two-tiles-spread"])
def test_heads_decided_apart_equal_eager_and_the_groups(case, pages_per_program):
    """Decisions, fail-safe, state after the step, statistics row, output and block counts: the eager criterion's
    (:func:`check_tail`), and bit for bit one program per KV group's (every setting: heavy set or none, a soft cap,
    sinks, a page hierarchy, ``attend_exact``, sizes grown with the context, both group policies; and with the page
    bounds spread over page-top programs of 5 pages, each head's program merging its own lists)."""
    (apart, apart_state), (together, together_state) = apart_and_together(case, pages_per_program)
    for name in FLAGS:
        torch.testing.assert_close(getattr(apart, name), getattr(together, name), atol=0, rtol=0, equal_nan=True,
                                   msg=name)
    torch.testing.assert_close(apart.output, together.output, atol=0, rtol=0)
    assert_same_state(apart_state, together_state)


def test_the_decision_launch_runs_a_program_per_query_head_without_host_reads(monkeypatch):
    """The decision launch's grid is ``(b H_kv, G)``, then the ``triton`` split and combine launches; no host read,
    only allocations and views; the default takes heads apart where ``b H`` fits the interpreter's one SM (2
    programs), not beyond."""
    from qada.attention.moment_step import estimate_launch
    from tests.triton_launches import ALLOCATIONS_AND_VIEWS, LaunchRecorder, refusing_host_reads

    step = make_step(2, 4, 2, 150, 16, [0, 9], [150, 130], torch.float32, seed=6)
    criterion, state = prepared(step, 6, heavy=4, observe=4, pages=2)
    tail = FusedTail(*(state[name] for name in STATE), criterion.page_size, criterion.pages)
    for heads_apart, G in ((True, 2), (None, 1)):  # (None: 8 heads > 2 programs, one per group)
        executor = FusedTritonExecutor(block_size=16, num_splits=3, decide_once=True, heads_apart=heads_apart)
        estimated = estimate_launch(executor.bulk_estimate(step.query, step.scale, step.softcap), step.moments)
        record = LaunchRecorder(monkeypatch)
        with refusing_host_reads(monkeypatch), record:
            executor.decide_and_attend(fresh(step), 0.3, "exact", tail, log_mean_exp=estimated)
        assert record.launches == [("qada_tail_fused_split_kernel", (4, G)), ("qada_decode_split_kernel", (4, 3)),
                                   ("qada_decode_combine_kernel", (2 * 4 + 1,))]
        assert set(record.ops) <= ALLOCATIONS_AND_VIEWS, record.ops
        monkeypatch.undo()


@st.composite
def head_decisions(draw):
    H_kv, G = draw(st.sampled_from([(2, 4), (3, 3), (4, 2), (1, 8), (2, 1)]))
    b = draw(st.integers(1, 3))
    decided = draw(st.lists(st.booleans(), min_size=b * H_kv * G, max_size=b * H_kv * G))
    ends = draw(st.lists(st.sampled_from([24, 130, 160]), min_size=b, max_size=b))  # 24: no bulk (window 32)
    policy = draw(st.sampled_from(["exact", "promote"]))
    return b, H_kv * G, H_kv, decided, ends, policy, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head_decisions())
def test_the_split_applies_the_group_policy_to_heads_decided_apart(case):
    """For any heads' own decisions (every head of a row without a bulk local, as the decision launch writes them)
    and either policy: the ``local`` and ``read`` split 0 writes are :func:`~qada.attention.apply_group_policy`'s,
    the output and bulk blocks the ``triton`` launch's on that decision; ``decided`` is read, not written."""
    b, H, H_kv, values, ends, policy, seed = case
    step = make_step(b, H, H_kv, 160, 16, None, ends, torch.float32, seed=seed)
    has_bulk = step.has_bulk.cpu()
    decided = torch.tensor(values, dtype=torch.bool).view(b, H) | ~has_bulk[:, None]
    want_local, want_read = apply_group_policy(decided, has_bulk, H_kv, policy)
    local = torch.full((b, H), True, dtype=torch.bool, device=DEVICE)  # (overwritten)
    read = torch.full((b, H_kv), policy == "exact", dtype=torch.bool, device=DEVICE)
    given_decided = decided.to(DEVICE)
    executor = TritonExecutor(group_policy=policy, block_size=16, num_splits=2)
    launch = executor.launch(fresh(step), GroupDecision(local, read),
                             heads=HeadsDecided(given_decided, policy == "promote"))
    assert torch.equal(local.cpu(), want_local) and torch.equal(read.cpu(), want_read)
    assert torch.equal(given_decided.cpu(), decided)
    reference = executor.launch(fresh(step), GroupDecision(want_local.to(DEVICE), want_read.to(DEVICE)))
    rtol, atol = TOLERANCE[torch.float32]
    torch.testing.assert_close(launch.output, reference.output, rtol=rtol, atol=atol)
    assert int(launch.bulk_blocks) == int(reference.bulk_blocks) and torch.equal(launch.counts, reference.counts)


def test_the_policy_in_the_split_needs_the_decision_it_writes_and_one_rule():
    step = make_step(1, 4, 2, 96, 16, None, None, torch.float32, seed=1)
    flags = [torch.zeros(1, 4, dtype=torch.bool, device=DEVICE) for _ in range(3)]
    read = torch.zeros(1, 2, dtype=torch.bool, device=DEVICE)
    executor = TritonExecutor(block_size=16, num_splits=2)
    heads = HeadsDecided(flags[0], False)
    with pytest.raises(ValueError, match="writes decision.local"):
        executor.launch(fresh(step), None, heads=heads)
    with pytest.raises(ValueError, match="decided as a contiguous torch.bool"):
        executor.launch(fresh(step), GroupDecision(flags[1], read), heads=heads._replace(decided=flags[0].long()))
    with pytest.raises(ValueError, match="local as a contiguous torch.bool"):
        executor.launch(fresh(step), GroupDecision(flags[1].t(), read), heads=heads)
    rank = BudgetRank(torch.zeros(1, 4, device=DEVICE), torch.tensor(1, device=DEVICE), False, False, flags[0],
                      flags[2])
    with pytest.raises(ValueError, match="not both"):
        executor.launch(fresh(step), GroupDecision(flags[1], read), rank=rank, heads=heads)

