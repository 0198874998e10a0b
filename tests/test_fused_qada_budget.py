"""The ``triton_fused`` executor with ``qada_budget``: eq. 7's scores in a launch of one program per (row, KV head),
the budget launch's ranking (per head and per KV group), then the ``triton`` launches, against the eager criterion,
the unfused ``triton`` executor and an unfused run. On CPU the kernels run in Triton's interpreter (small shapes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from qada.attention import FusedTritonExecutor, apply_group_policy  # noqa: E402
from qada.attention.fused import FusedBudget  # noqa: E402
from qada.criteria import BudgetedQAdACriterion  # noqa: E402
from tests.test_attention_triton import DEVICE  # noqa: E402
from tests.test_fused_budget import (  # noqa: E402
    assert_ties_and_broken_group,
    check_budget,
    tied_step_with_a_broken_group,
)
from tests.test_fused_decision import (  # noqa: E402
    fresh,
    fused_steps,
    greedy,
    make_run,
    make_step,
    model,  # noqa: F401 (a module-scoped fixture)
    reference,  # noqa: F401 (a module-scoped fixture)
)


def prepared(step, sparsity, per_group):
    """A ``qada_budget`` criterion bound to a one-layer model of the step's heads and its layer 0 state (the
    layer's count)."""
    criterion = BudgetedQAdACriterion(sparsity=sparsity, per_group=per_group)
    criterion.check_model(1, step.num_heads)
    return criterion, criterion.layer_state(0, step.length)


def eager(criterion, step, state, policy):
    step = fresh(step)
    step.states = {"criterion": state}
    decided = criterion.decide(step)
    local, read = apply_group_policy(decided, step.has_bulk, step.num_kv_heads, policy)
    fail_safe = torch.zeros((), dtype=torch.long) if step.fail_safe is None else step.fail_safe
    return decided, local, read, fail_safe, criterion.score(step), step


def count_of(criterion, state, G):
    return state["count"] if not criterion.per_group else state[f"group_count_{G}"]


def fused(criterion, step, state, policy, block=16, splits=3):
    G = step.num_heads // step.num_kv_heads
    executor = FusedTritonExecutor(group_policy=policy, block_size=block, num_splits=splits)
    budget = FusedBudget(count_of(criterion, state, G).to(DEVICE), criterion.per_group)
    return executor.decide_and_attend(fresh(step), 0.0, policy, None, budget)


CASES = [  # (b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, sparsity, per_group)
    (2, 8, 2, 600, 16, None, None, torch.float32, None, False, "exact", 0.5, False),
    (2, 8, 2, 520, 32, [0, 60], [500, 513], torch.float32, None, False, "promote", 0.6, False),
    (2, 12, 4, 400, 32, [10, 0], [385, 40], torch.bfloat16, None, False, "exact", 0.5, True),  # row 1: no bulk
    (3, 8, 4, 320, 16, [0, 7, 3], None, torch.float32, 4.0, True, "exact", 0.75, True),
    (2, 6, 2, 360, 32, None, [360, 333], torch.bfloat16, None, True, "promote", 0.34, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C{c[3]}-H{c[1]}-{str(c[7])[6:]}-{c[10]}-s{c[11]}-g{c[12]}")
def test_fused_qada_budget_equals_eager(case):
    """Scores, decisions, fail-safe, the statistics row, and the output of the ``triton`` executor on the same
    decision; every row with a bulk keeps exactly its count local."""
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, sparsity, per_group = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C + H, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, sparsity, per_group)
    decided, local, read, fail_safe, score, eager_step = eager(criterion, step, state, policy)
    got = fused(criterion, step, state, policy)
    check_budget(got, (decided, local, read, fail_safe, score), eager_step, criterion, step, policy,
                 int(count_of(criterion, state, H // H_kv)), per_group)


def test_ties_go_to_the_lower_head_and_non_finite_heads_are_dense():
    """Equal scores (the same query in every head) keep the lowest heads local; a NaN key in a window makes its
    group's heads non-finite: never local, counted, and the budget goes to the other heads."""
    step = tied_step_with_a_broken_group()
    criterion, state = prepared(step, 0.25, False)
    decided, _, _, fail_safe, _, _ = eager(criterion, step, state, "exact")
    assert_ties_and_broken_group(fused(criterion, step, state, "exact"), decided, fail_safe)


def test_three_launches_and_no_host_reads(monkeypatch):
    """Called without ``log E[exp(s)]``: the estimate, the scores, the split (which ranks them) and the combine."""
    from tests.triton_launches import ALLOCATIONS_AND_VIEWS, LaunchRecorder, refusing_host_reads

    step = make_step(2, 8, 2, 200, 16, [0, 9], [200, 180], torch.float32, seed=6)
    criterion, state = prepared(step, 0.5, True)
    record = LaunchRecorder(monkeypatch)
    with refusing_host_reads(monkeypatch), record:
        fused(criterion, step, state, "exact")
    names = [name for name, _ in record.launches]
    assert names == ["bulk_estimate_kernel",  # (called without log E[exp(s)], which a run's moment step writes)
                     "qada_budget_score_kernel", "qada_decode_split_kernel", "qada_decode_combine_kernel"]
    assert record.launches[1][1] == (4,) and record.launches[2][1] == (4, 3)
    assert set(record.ops) <= ALLOCATIONS_AND_VIEWS, record.ops


def test_a_plain_budget_takes_no_decision_made_with_the_estimate():
    step = make_step(1, 4, 2, 100, 16, None, None, torch.float32, seed=2)
    executor = FusedTritonExecutor(decide_once=True)
    decision = executor.estimate_decision(step.query, step.keys, None, None, None, 0.5, "exact", step.window)
    with pytest.raises(ValueError, match="launches of its own"):
        executor.decide_and_attend(step, 0.0, "exact", None, FusedBudget(torch.tensor(1)), decision=decision)


@pytest.mark.parametrize(("source", "cache", "per_group", "decide_once"),
                         [("stored", "static", False, None), ("current", "dynamic", True, True)])
def test_model_fused_qada_budget_run_equals_triton_run(model, reference, source, cache, per_group,  # noqa: F811
                                                       decide_once):
    """A whole decode (two rows, one left-padded) with the decision in the kernels: the tokens and statistics of the
    same criterion on the unfused ``triton`` executor, every step decided by the fused launches."""
    criterion = {"name": "qada_budget", "sparsity": 0.5, "per_group": per_group}
    unfused = greedy(model, make_run(source, {"name": "triton", "block_size": 16}, reference, criterion), cache)
    calls: list = []
    with fused_steps(calls):
        executor = {"name": "triton_fused", "block_size": 16, "decide_once": decide_once}
        fused_run = greedy(model, make_run(source, executor, reference, criterion), cache)
    assert calls and all(calls)
    assert torch.equal(fused_run[0], unfused[0])
    for key in ("sparsity", "kv_sparsity", "kv_read"):
        assert fused_run[1][key] == pytest.approx(unfused[1][key], abs=1e-12), key
    assert fused_run[1]["fail_safe"] == unfused[1]["fail_safe"]
    assert 0.0 < fused_run[1]["sparsity"] < 1.0


COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qada.attention import _fused_budget_kernel as K

    kernel = K.qada_budget_score_kernel
    for rows, dtype, sinks in ((True, "bf16", True), (False, "fp16", False)):
        pointers = dict(Q=f"*{dtype}", K=f"*{dtype}", LME="*fp32", START="*i64" if rows else f"*{dtype}",
                        END="*i64" if rows else f"*{dtype}", SINKS="*fp32" if sinks else f"*{dtype}", SCORE="*fp32")
        constants = dict(G=4, D=128, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, HAS_START=rows, HAS_END=rows,
                         SOFTCAP=sinks, HAS_SINKS=sinks, INPUT_PRECISION=None, DOT_FP32=False)
        names = kernel.arg_names
        floats = ("scale", "softcap")
        signature = {n: pointers.get(n, "constexpr" if n in constants else "fp32" if n in floats else "i32")
                     for n in names}
        source = ASTSource(kernel, signature, constexprs={(names.index(n),): c for n, c in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    print("compiled")
    """
)


def test_score_kernel_compiles_for_the_gpu():
    """The score launch compiles (TTIR .. cubin) for sm_90 without a GPU, at Llama-3-8B's heads (4 query heads per
    KV head, d = 128), bfloat16 with rows, sinks and a soft cap, float16 without."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
