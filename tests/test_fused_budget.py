"""The ``triton_fused`` executor with ``qada_tail_budget``: the tail kernel's scores, their ranking in the ``triton``
split launch after it (per head and per KV group, ties to the lower index, non-finite scores never local) and the
combine, against the eager criterion, the unfused ``triton`` executor and an unfused run. On CPU the kernels run in
Triton's interpreter (small shapes)."""

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

from qada.attention import EXECUTORS, FusedTritonExecutor, apply_group_policy  # noqa: E402
from qada.attention.base import GroupDecision  # noqa: E402
from qada.attention.fused import FusedBudget, FusedTail  # noqa: E402
from qada.criteria import TailBudgetCriterion  # noqa: E402
from qada.models.step_parts import statistics_row  # noqa: E402
from tests.test_attention_triton import DEVICE, TOLERANCE  # noqa: E402
from tests.test_fused_decision import fresh, make_step  # noqa: E402
from tests.test_fused_tail import STATE, assert_same_state, with_state  # noqa: E402
from tests.test_fused_tail import prepared as prepared_tail  # noqa: E402


def prepared(step, seed, sparsity, per_group, **sizes):
    """A ``qada_tail_budget`` criterion bound to a one-layer model of the step's heads, its layer 0 prefilled on all
    slots but the last: ``(criterion, state)`` (the tail index and the layer's count)."""
    criterion = TailBudgetCriterion(sparsity=sparsity, per_group=per_group, **sizes)
    criterion.check_model(1, step.num_heads)
    criterion, _ = prepared_tail(step, seed, criterion=criterion)
    return criterion, {name: t.clone() for name, t in criterion.layer_state(0, step.length).items()}


def eager(criterion, step, state, policy):
    state = {name: t.clone() for name, t in state.items()}
    step = with_state(step, state)
    decided = criterion.decide(step)
    local, read = apply_group_policy(decided, step.has_bulk, step.num_kv_heads, policy)
    fail_safe = torch.zeros((), dtype=torch.long) if step.fail_safe is None else step.fail_safe
    return decided, local, read, fail_safe, criterion.score(step), state, step


def fused(criterion, step, state, policy, block=16, splits=3, pages_per_program=256, heads_apart=None):
    state = {name: t.clone() for name, t in state.items()}
    G = step.num_heads // step.num_kv_heads
    count = state["count"] if not criterion.per_group else state[f"group_count_{G}"]
    tail = FusedTail(*(state[name] for name in STATE), criterion.page_size, criterion.pages,
                     None if criterion.heavy else 0)
    executor = FusedTritonExecutor(group_policy=policy, block_size=block, num_splits=splits,
                                   pages_per_program=pages_per_program, heads_apart=heads_apart)
    launch = executor.decide_and_attend(fresh(step), 0.0, policy, tail,
                                        FusedBudget(count.to(DEVICE), criterion.per_group))
    return launch, state


CASES = [  # (b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, sparsity, per_group, sizes)
    (2, 8, 2, 600, 16, None, None, torch.float32, None, False, "exact", 0.5, False, {}),
    (2, 8, 2, 520, 32, [0, 60], [500, 513], torch.float32, None, False, "promote", 0.6, False,
     dict(heavy=8, observe=4, pages=4)),
    (2, 12, 4, 400, 32, [10, 0], [385, 40], torch.bfloat16, None, False, "exact", 0.5, True,
     dict(heavy=16, observe=8, page_size=8, pages=3)),  # row 1: no bulk
    (3, 8, 4, 320, 16, [0, 7, 3], None, torch.float32, 4.0, True, "exact", 0.75, True,
     dict(heavy=8, observe=4, pages=2)),
    (2, 6, 2, 360, 32, None, [360, 333], torch.bfloat16, None, True, "promote", 0.34, False, dict(heavy=0, pages=5)),
]


@pytest.mark.parametrize("pages_per_program", [256, 7], ids=["one-program", "spread"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C{c[3]}-H{c[1]}-{str(c[7])[6:]}-{c[10]}-s{c[11]}-g{c[12]}")
def test_fused_budget_equals_eager(case, pages_per_program):
    """Decisions, fail-safe, the tail index after the step, the statistics row, and the output of the ``triton``
    executor on the same decision; every row with a bulk keeps exactly its count local. ``spread``: the page bounds
    over programs of 7 pages (a page-top launch first)."""
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, sparsity, per_group, sizes = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C + H, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, sparsity, per_group, **sizes)
    decided, local, read, fail_safe, score, state_after, eager_step = eager(criterion, step, state, policy)
    got, got_state = fused(criterion, step, state, policy, pages_per_program=pages_per_program)
    assert_same_state({name: got_state[name] for name in STATE}, {name: state_after[name] for name in STATE})
    check_budget(got, (decided, local, read, fail_safe, score), eager_step, criterion, step, policy,
                 int(state["count"] if not per_group else state[f"group_count_{H // H_kv}"]), per_group)


@pytest.mark.parametrize("pages_per_program", [256, 7], ids=["one-program", "spread"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C{c[3]}-H{c[1]}-{str(c[7])[6:]}-{c[10]}-s{c[11]}-g{c[12]}")
def test_launches_heads_apart_equal_the_groups(case, pages_per_program):
    """The score launch with one program per query head (``heads_apart``) writes the same scores, sizes of the exact
    set and tail index as one program per KV group, so the same decision and output."""
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, sparsity, per_group, sizes = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C + H, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, sparsity, per_group, **sizes)
    group, group_state = fused(criterion, step, state, policy, pages_per_program=pages_per_program, heads_apart=False)
    apart, apart_state = fused(criterion, step, state, policy, pages_per_program=pages_per_program, heads_apart=True)
    assert torch.equal(apart.log_ratio.isnan(), group.log_ratio.isnan())
    torch.testing.assert_close(apart.log_ratio, group.log_ratio, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(apart.n_exact, group.n_exact) and torch.equal(apart.decided, group.decided)
    assert torch.equal(apart.local, group.local) and torch.equal(apart.read, group.read)
    assert torch.equal(apart.output, group.output) and torch.equal(apart.row, group.row)
    assert_same_state({name: apart_state[name] for name in STATE}, {name: group_state[name] for name in STATE})


LEAN_CASES = [  # (b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, sparsity, per_group, sizes)
    (2, 6, 2, 520, 32, [0, 60], [500, 513], torch.bfloat16, None, True, "promote", 0.5, True,
     dict(heavy=8, observe=4, pages=2, super_page=3, super_pages=3, attend_exact=True)),  # the read-lean settings
    (2, 8, 2, 400, 32, [10, 0], [385, 300], torch.float32, 4.0, False, "exact", 0.5, False,
     dict(heavy=16, observe=8, page_size=8, pages=3, attend_exact=True)),  # one level, a soft cap
]


@pytest.mark.parametrize("case", LEAN_CASES, ids=["hierarchy-exact-group", "exact-softcap"])
def test_launches_heads_apart_with_the_exact_set_and_a_hierarchy(case):
    """With ``attend_exact`` (each head's attention over ``E``, merged by the combine) and a page hierarchy (the
    group's best super-pages), one program per query head gives the same scores, attention over ``E``, output and
    tail index (super-pages included) as one per KV group."""
    from qada.models.fused_step import fused_tail

    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, sparsity, per_group, sizes = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C + H, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, sparsity, per_group, **sizes)
    G = H // H_kv
    count = state["count"] if not per_group else state[f"group_count_{G}"]
    launches = []
    for apart in (False, True):
        copy = {name: t.clone() for name, t in state.items()}
        tail = fused_tail(criterion, with_state(step, copy))
        assert tail.attend_exact and (tail.super_page > 0) == ("super_page" in sizes)
        executor = FusedTritonExecutor(group_policy=policy, block_size=16, num_splits=3, heads_apart=apart)
        launch = executor.decide_and_attend(fresh(step), 0.0, policy, tail, FusedBudget(count.to(DEVICE), per_group))
        launches.append((launch, copy))
    (group, group_state), (apart, apart_state) = launches
    torch.testing.assert_close(apart.log_ratio, group.log_ratio, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(apart.n_exact, group.n_exact) and torch.equal(apart.local, group.local)
    assert torch.equal(apart.output, group.output) and torch.equal(apart.row, group.row)
    assert_same_state(apart_state, group_state)


def test_heads_apart_by_default_where_the_grid_fits_one_wave():
    executor = FusedTritonExecutor()
    assert executor.launches_heads_apart(torch.device("cpu"), 2) and not executor.launches_heads_apart(
        torch.device("cpu"), 3)  # (the interpreter counts one SM: two programs)
    assert FusedTritonExecutor(heads_apart=True).launches_heads_apart(torch.device("cpu"), 1000)
    assert not FusedTritonExecutor(heads_apart=False).launches_heads_apart(torch.device("cpu"), 1)
    with pytest.raises(ValueError, match="heads_apart"):
        FusedTritonExecutor(heads_apart=1)


def assert_keeps_its_count(decided, has_bulk, count, per_group, H_kv, broken=None, not_vacuous=True):
    """Every row with a bulk keeps exactly ``count`` heads (``per_group``: whole KV groups) of ``decided [b, H]``
    local, a count strictly between none and all (``not_vacuous``); a row without a bulk is all local. ``broken [b,
    H]``: the rows with a head forced dense (non-finite) are not held to the count."""
    b, H = decided.shape
    kept = decided.view(b, H_kv, H // H_kv).all(-1).sum(-1) if per_group else decided.sum(-1)
    counted = has_bulk if broken is None else has_bulk & ~broken.any(-1)
    assert (kept[counted] == count).all(), (kept, count)
    assert 0 < count < (H_kv if per_group else H) or not not_vacuous
    assert decided[~has_bulk].all()


def tied(score: torch.Tensor) -> bool:
    """Two finite scores within 1e-4 of each other: a ranking that rounding may order either way."""
    finite = score[torch.isfinite(score)].double().flatten().sort().values
    return finite.numel() > 1 and bool((finite[1:] - finite[:-1]).min() < 1e-4)


def check_budget(got, expected, eager_step, criterion, step, policy, count, per_group, drawn=False):
    """A fused budget launch ``got`` against the eager criterion's ``expected = (decided, local, read, fail_safe,
    score)``: the scores, decisions, fail-safe count, statistics row and the ``triton`` executor's output on the same
    decision; every row with a bulk keeps exactly ``count`` local (:func:`assert_keeps_its_count`). ``drawn`` (a
    generated case): the decisions and row only without near ties (:func:`tied`), the count in the rows without a
    broken head and of any size."""
    decided, local, read, fail_safe, score = expected
    finite = torch.isfinite(score)
    torch.testing.assert_close(got.log_ratio[finite], score[finite].float(), atol=2e-5, rtol=1e-4)
    assert torch.equal(torch.isfinite(got.log_ratio), finite)
    assert int(got.broken.sum()) == int(fail_safe)
    if not (drawn and tied(score)):
        assert torch.equal(got.decided, decided) and torch.equal(got.local, local) and torch.equal(got.read, read)
        assert torch.equal(got.row, statistics_row(eager_step, got.local, got.read, got.broken, criterion))
    unfused = EXECUTORS.build("triton", group_policy=policy, block_size=16, num_splits=3)
    expected_output = unfused.launch(fresh(step), GroupDecision(got.local, got.read)).output
    atol, rtol = TOLERANCE[step.query.dtype]
    torch.testing.assert_close(got.output.float(), expected_output.float(), atol=atol, rtol=rtol)
    assert_keeps_its_count(got.decided, eager_step.has_bulk, count, per_group, step.num_kv_heads,
                           broken=got.broken if drawn else None, not_vacuous=not drawn)


def tied_step_with_a_broken_group():
    """One row of 8 heads on 2 KV heads, every head asking the same query (equal scores within a group), and a NaN
    key in KV head 1's window (its 4 query heads not finite)."""
    from qada.step import DecodeStep

    step = make_step(1, 8, 2, 300, 16, None, None, torch.float32, seed=11)
    query = step.query.clone()
    query[:, :] = query[:, :1]
    keys = step.keys.clone()
    keys[0, 1, -3] = float("nan")
    return DecodeStep(query, keys, step.scale, step.window, moments=step.moments, values=step.values)


def assert_ties_and_broken_group(got, decided, fail_safe):
    """On :func:`tied_step_with_a_broken_group` at sparsity 0.25: the broken group's heads are dense and counted, and
    the budget's two local heads are the lowest of the other group."""
    assert int(fail_safe) == 4 and int(got.broken.sum()) == 4 and got.broken[0, 4:].all()
    assert torch.equal(got.decided, decided)
    assert got.decided[0].tolist() == [True, True, False, False, False, False, False, False]


def test_ties_go_to_the_lower_head_and_non_finite_heads_are_dense():
    """Equal scores (the same query in every head) keep the lowest heads local; a NaN key in a window makes its
    group's heads non-finite: never local, counted, and the budget goes to the other heads."""
    step = tied_step_with_a_broken_group()
    criterion, state = prepared(step, 5, 0.25, False, heavy=8, observe=4, pages=2)
    decided, _, _, fail_safe, _, _, _ = eager(criterion, step, state, "exact")
    got, _ = fused(criterion, step, state, "exact")
    assert_ties_and_broken_group(got, decided, fail_safe)


def test_three_launches_and_no_host_reads(monkeypatch):
    """Called without ``log E[exp(s)]``: the estimate, the tail kernel's scores, the split (which ranks them) and the
    combine."""
    from tests.triton_launches import ALLOCATIONS_AND_VIEWS, LaunchRecorder, refusing_host_reads

    step = make_step(2, 8, 2, 200, 16, [0, 9], [200, 180], torch.float32, seed=6)
    criterion, state = prepared(step, 3, 0.5, True, heavy=8, observe=4, pages=2)
    record = LaunchRecorder(monkeypatch)
    with refusing_host_reads(monkeypatch), record:
        fused(criterion, step, state, "exact")
    names = [name for name, _ in record.launches]
    assert names == ["bulk_estimate_kernel",  # (called without log E[exp(s)], which a run's moment step writes)
                     "qada_tail_fused_split_kernel", "qada_decode_split_kernel", "qada_decode_combine_kernel"]
    assert record.launches[1][1] == (4, 1) and record.launches[2][1] == (4, 3)
    copies = {"aten.clone.default", "aten._to_copy.default"}  # (the test's own state copies)
    assert set(record.ops) <= ALLOCATIONS_AND_VIEWS | copies, record.ops


COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qada.attention import _triton_kernel as K

    kernel = K.qada_decode_split_kernel
    # the budget ranked (RANK), or the group policy on heads decided apart (POLICY: SCORE, COUNT, BROKEN not read)
    for rows, per_group, rank, pdl in ((True, True, True, False), (False, False, True, False),
                                       (True, False, False, False), (True, True, False, True)):
        pointers = dict(Q="*bf16", K="*bf16", V="*bf16", LOCAL="*u8", START="*i64" if rows else "*bf16",
                        END="*i64" if rows else "*bf16", ACC="*fp32", M="*fp32", L="*fp32", COUNTS="*i32",
                        SCORE="*fp32" if rank else "*u8", COUNT="*i64" if rank else "*u8", DECIDED="*u8",
                        BROKEN="*u8", READ="*u8")
        constants = dict(G=4, D=128, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, HAS_START=rows, HAS_END=rows,
                         INPUT_PRECISION=None, DOT_FP32=False, SOFTCAP=False, PDL=pdl, ALL_DENSE=False, RANK=rank,
                         BLOCK_H=32, BLOCK_KV=16, PER_GROUP=per_group, PROMOTE=per_group, POLICY=not rank)
        names = kernel.arg_names
        signature = {n: pointers.get(n, "constexpr" if n in constants else "fp32" if n in ("qk_scale", "softcap")
                                     else "i32") for n in names}
        source = ASTSource(kernel, signature, constexprs={(names.index(n),): c for n, c in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    print("compiled")
    """
)


def test_the_deciding_splits_compile_for_the_gpu():
    """The split kernel that ranks a budget's scores compiles (TTIR .. cubin) for sm_90 without a GPU, at
    Llama-3-8B's heads (32 over 8 KV heads), per head and per group, and so does the one that applies the group
    policy to heads decided apart (``tests/test_tail_heads_apart.py``), with and without ``promote`` and PDL
    (``benchmarks/kernel_resources.py`` compiles both as a decode step launches them, and
    ``tests/test_kernel_resources.py`` checks their loops are pipelined)."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
