"""The budget rule made inside the ``triton`` split launch (``BudgetRank``, the split kernel's ``RANK`` mode): for any
scores (ties, NaN, infinities), counts, rows with and without a bulk, per head or per KV group and either group
policy, the decision split 0 writes and the attention the splits compute equal the torch rule's
(:func:`~qada.criteria.budget.top_k_mask` as :meth:`~qada.criteria.BudgetedQAdACriterion.decide` ranks, then
:func:`~qada.attention.apply_group_policy`) and the ``triton`` launch on that decision. On CPU the kernels run in
Triton's interpreter (small shapes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qada.attention import TritonExecutor, apply_group_policy  # noqa: E402
from qada.attention.base import GroupDecision  # noqa: E402
from qada.attention.triton_decode import BudgetRank  # noqa: E402
from qada.criteria.budget import top_k_mask  # noqa: E402
from tests.test_attention_triton import DEVICE, TOLERANCE  # noqa: E402
from tests.test_fused_decision import fresh, make_step  # noqa: E402


def torch_rule(score, count, has_bulk, G, per_group, policy):
    """``(decided, local, read, broken)`` as the eager criterion and group policy make them."""
    b, H = score.shape
    finite = torch.isfinite(score)
    ranked = torch.where(finite, score, torch.full_like(score, float("-inf")))
    if per_group:
        group_finite = finite.view(b, H // G, G).all(-1)
        group_score = torch.where(group_finite, ranked.view(b, H // G, G).amin(-1), float("-inf"))
        chosen = (top_k_mask(group_score, count) & group_finite).repeat_interleave(G, dim=1)
    else:
        chosen = top_k_mask(ranked, count) & finite
    decided = chosen | ~has_bulk[:, None]
    local, read = apply_group_policy(decided, has_bulk, H // G, policy)
    return decided, local, read, ~finite & has_bulk[:, None]


def ranked_launch(step, score, count, per_group, policy, splits=2):
    """The split launch ranking ``score``: ``(launch, decided, local, read, broken)``."""
    b, H = score.shape
    flags = [torch.full((b, H), True, dtype=torch.bool, device=DEVICE) for _ in range(3)]  # (overwritten)
    read = torch.full((b, step.num_kv_heads), True, dtype=torch.bool, device=DEVICE)
    rank = BudgetRank(score.to(DEVICE), torch.tensor(count, device=DEVICE), per_group, policy == "promote",
                      flags[0], flags[2])
    executor = TritonExecutor(group_policy=policy, block_size=16, num_splits=splits)
    launch = executor.launch(fresh(step), GroupDecision(flags[1], read), rank=rank)
    return launch, flags[0], flags[1], read, flags[2]


SPECIAL = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.5, 0.5, -1.0])


@st.composite
def budget_cases(draw):
    H_kv, G = draw(st.sampled_from([(2, 4), (3, 3), (4, 2), (1, 8)]))
    H = H_kv * G
    b = draw(st.integers(1, 3))
    values = draw(st.lists(st.one_of(st.floats(-4, 4, width=32), SPECIAL), min_size=b * H, max_size=b * H))
    per_group = draw(st.booleans())
    count = draw(st.integers(0, (H_kv if per_group else H) + 1))
    ends = draw(st.lists(st.sampled_from([24, 130, 160]), min_size=b, max_size=b))  # 24: no bulk (window 32)
    policy = draw(st.sampled_from(["exact", "promote"]))
    return b, H, H_kv, values, per_group, count, ends, policy, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget_cases())
def test_the_split_ranks_as_the_criterion_decides(case):
    b, H, H_kv, values, per_group, count, ends, policy, seed = case
    step = make_step(b, H, H_kv, 160, 16, None, ends, torch.float32, seed=seed)
    score = torch.tensor(values, dtype=torch.float32).view(b, H)
    expected = torch_rule(score, count, step.has_bulk.cpu(), H // H_kv, per_group, policy)
    launch, *got = ranked_launch(step, score, count, per_group, policy)
    for name, want, have in zip(("decided", "local", "read", "broken"), expected, got, strict=True):
        assert torch.equal(have.cpu(), want), (name, have, want)
    reference = TritonExecutor(group_policy=policy, block_size=16, num_splits=2).launch(
        fresh(step), GroupDecision(expected[1].to(DEVICE), expected[2].to(DEVICE)))
    rtol, atol = TOLERANCE[torch.float32]
    torch.testing.assert_close(launch.output, reference.output, rtol=rtol, atol=atol)
    assert int(launch.bulk_blocks) == int(reference.bulk_blocks)


def test_a_ranked_launch_needs_the_decision_it_writes_and_a_0d_count():
    step = make_step(1, 4, 2, 96, 16, None, None, torch.float32, seed=1)
    flags = [torch.zeros(1, 4, dtype=torch.bool, device=DEVICE) for _ in range(3)]
    read = torch.zeros(1, 2, dtype=torch.bool, device=DEVICE)
    score = torch.zeros(1, 4, device=DEVICE)
    executor = TritonExecutor(block_size=16, num_splits=2)
    rank = BudgetRank(score, torch.tensor(1, device=DEVICE), False, False, flags[0], flags[2])
    with pytest.raises(ValueError, match="writes its decision"):
        executor.launch(fresh(step), None, rank=rank)
    with pytest.raises(ValueError, match="0-d int64"):
        executor.launch(fresh(step), GroupDecision(flags[1], read),
                        rank=rank._replace(count=torch.tensor([1], device=DEVICE)))
    with pytest.raises(ValueError, match="score as a contiguous torch.float32"):
        executor.launch(fresh(step), GroupDecision(flags[1], read), rank=rank._replace(score=score.double()))
    with pytest.raises(ValueError, match="read as a contiguous torch.bool"):
        executor.launch(fresh(step), GroupDecision(flags[1], read[:, :1]), rank=rank)
