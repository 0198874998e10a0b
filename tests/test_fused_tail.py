"""The ``triton_fused`` executor with the tail-aware ``qada_tail`` criterion: the decision (window, heavy set, top
pages, eq. 7 on the rest) and the step key's page update in the split kernel, against the eager criterion, the
unfused ``triton`` executor and an unfused run. On CPU the kernels run in Triton's interpreter (small shapes)."""

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

from tiny_models import tiny_model  # noqa: E402
from transformers import DynamicCache, StaticCache  # noqa: E402

from qada.attention import EXECUTORS, FusedTritonExecutor, apply_group_policy  # noqa: E402
from qada.attention.base import GroupDecision  # noqa: E402
from qada.attention.fused import FusedTail  # noqa: E402
from qada.criteria import TailCriterion  # noqa: E402
from qada.functional import local_ratio  # noqa: E402
from qada.functional.extra_set import attend_extra, merge_extra  # noqa: E402
from qada.models import attach  # noqa: E402
from qada.models.fused_step import fused_tail  # noqa: E402
from qada.models.layer_step import LayerStep  # noqa: E402
from qada.models.step_parts import statistics_row  # noqa: E402
from qada.step import DecodeStep  # noqa: E402
from qada.window import Window  # noqa: E402
from tests.test_attention_triton import DEVICE, TOLERANCE, hand_blocks  # noqa: E402
from tests.test_fused_decision import fresh, make_run, make_step, tau_between  # noqa: E402

STATE = ("heavy", "heavy_valid", "member", "kmin", "kmax", "halves")
SUPER_STATE = ("super_kmin", "super_kmax", "super_halves")  # with a page hierarchy


def prepared(step, seed, filled=None, criterion=None, **sizes):
    """A ``qada_tail`` criterion (or ``criterion``, a tail-aware one) whose layer 0 was prefilled on the step's first
    ``filled`` slots (default: all but the last), with random observation queries, and a copy of that state:
    ``(criterion, state)``."""
    criterion = criterion if criterion is not None else TailCriterion(tau=0.5, **sizes)
    g = torch.Generator().manual_seed(seed)
    b, H, d = step.query.shape
    C = step.length
    filled = C - 1 if filled is None else filled
    queries = torch.randn(b, H, criterion.observe, d, generator=g).to(DEVICE)
    queries[:, :, -1] += 2.0 * step.query.float()  # (votes near the step's own query: a heavy set that matters)
    criterion.observe_prefill(0, step.keys[:, :, :filled], queries.to(step.query.dtype), step.scale, step.start,
                              step.window, capacity=C)
    return criterion, copy_state(criterion.layer_state(0, C))


def copy_state(state):
    return {name: state[name].clone() for name in STATE + SUPER_STATE if name in state}


def with_state(step, state):
    """``step`` afresh, reading ``state`` as the run passes it."""
    step = fresh(step)
    step.states = {"criterion": state}
    return step


def eager_tail(criterion, step, state, tau, policy="exact"):
    """The eager ``qada_tail`` criterion and group policy on a copy of ``state``: ``(decided, local, read,
    fail_safe, ratio, state after, step)``."""
    state = copy_state(state)
    step = with_state(step, state)
    criterion.tau = tau
    decided = criterion.decide(step)
    local, read = apply_group_policy(decided, step.has_bulk, step.num_kv_heads, policy)
    fail_safe = torch.zeros((), dtype=torch.long) if step.fail_safe is None else step.fail_safe
    ratio = local_ratio(criterion.log_local(step), criterion.log_bulk(step))
    return decided, local, read, fail_safe, ratio, state, step


def fused_tail_launch(criterion, step, state, tau, policy="exact", block=16, splits=3, decide_once=False,
                      pages_per_program=256, **options):  # (decide_once False by default here: the split kernel's)
    """The fused launch on a copy of ``state``: ``(launch, state after)``; ``options``: the executor's others."""
    state = copy_state(state)
    tail = fused_tail(criterion, with_state(step, state))  # as a run passes it (no heavy set: 0 heavy reads)
    executor = FusedTritonExecutor(group_policy=policy, block_size=block, num_splits=splits, decide_once=decide_once,
                                   pages_per_program=pages_per_program, **options)
    return executor.decide_and_attend(fresh(step), tau, policy, tail), state


def assert_same_state(got, expected):
    assert got.keys() == expected.keys()
    for name in got:  # bit for bit (the pages beyond the filled slots hold NaN halves in both)
        torch.testing.assert_close(got[name], expected[name], atol=0, rtol=0, equal_nan=True, msg=name)


def check_tail(criterion, step, state, tau, policy="exact", block=16, splits=3, decide_once=False,
               pages_per_program=256, exact_matters=True, **options):
    """The fused launch against the eager criterion (decisions, fail-safe, state after the step), the unfused
    ``triton`` executor on the fused decision (output, block counts) and :func:`hand_blocks`; ``options``: the
    executor's others. ``exact_matters``: with ``attend_exact``, the exact set must change some local head's output
    (a hand-picked case's check that it is not vacuous; a generated case may have an empty or negligible one)."""
    decided, local, read, fail_safe, ratio, state_after, eager_step = eager_tail(criterion, step, state, tau,
                                                                                 policy)
    got, got_state = fused_tail_launch(criterion, step, state, tau, policy, block, splits, decide_once,
                                       pages_per_program, **options)
    near = (ratio - tau).abs() <= 1e-4 * tau  # rounding may decide these either way (none with tau_between)
    assert torch.equal(got.decided | near, decided | near) and torch.equal(got.decided & ~near, decided & ~near)
    if not near.any():
        assert torch.equal(got.decided, decided) and torch.equal(got.local, local) and torch.equal(got.read, read)
    assert int(got.broken.sum()) == int(fail_safe)
    expected_row = statistics_row(eager_step, got.local, got.read, got.broken, criterion)
    assert torch.equal(got.row, expected_row), (got.row, expected_row)  # kv_read with the tail's reads: exact
    assert_same_state(got_state, state_after)
    scores, valid = criterion.exact_set(eager_step)  # (the state after the step: E as the eager step chose it)
    assert torch.equal(got.n_exact.long(), valid.sum(-1))
    ok = ~got.broken & eager_step.has_bulk[:, None]
    torch.testing.assert_close(got.log_ratio.exp()[ok], ratio[ok], atol=2e-6, rtol=1e-4)
    unfused = EXECUTORS.build("triton", group_policy=policy, block_size=block, num_splits=splits)
    expected = unfused.launch(fresh(step), GroupDecision(got.local, got.read))
    atol, rtol = TOLERANCE[step.query.dtype]
    assert got.output.shape == (*step.query.shape[:2], 1, step.head_dim) and got.output.dtype == step.query.dtype
    expected_output = expected.output.float()
    if criterion.attend_exact:  # local heads over window ∪ E: the eager step's extra set merged in, as a run does
        extra_output, log_extra = attend_extra(step.values, *eager_step.extra_set)
        expected_output = merge_extra(expected_output, eager_step.log_local, extra_output, log_extra, got.local)
        changed = (expected_output - expected.output.float()).abs().amax(-1)[..., 0] > 10 * atol
        kept = got.local & eager_step.has_bulk[:, None]
        assert changed[kept].any() or not kept.any() or not exact_matters  # not vacuous: E changed a local output
    torch.testing.assert_close(got.output.float(), expected_output, atol=atol, rtol=rtol)
    starts = None if step.start is None else step.start.tolist()
    ends = None if step.end is None else step.end.tolist()
    loaded, bulk_only = hand_blocks(step.length, block, starts, ends, got.local.cpu(), step.num_kv_heads, step.window)
    assert got.bulk_blocks.item() == bulk_only and got.counts[..., 1].sum().item() == loaded
    assert torch.equal(got.counts, expected.counts)
    return got, (decided, local, read, fail_safe, ratio), got_state


def tail_tau(criterion, step, state, G, policy="exact"):
    """A threshold far from every eager ratio that leaves some groups local and some dense."""
    *_, ratio, _, eager_step = eager_tail(criterion, step, state, 0.5, policy)
    return tau_between(ratio, eager_step.has_bulk, G)


CASES = [  # (b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes)
    (2, 4, 2, 600, 16, None, None, torch.float32, None, False, "exact", 16, 3, {}),  # the defaults: 32 heavy, 8 pages
    (2, 6, 2, 520, 32, [0, 60], [500, 513], torch.float32, None, False, "promote", 32, 4,
     dict(heavy=8, observe=4, pages=4)),  # row 1: its step key starts a page
    (2, 4, 2, 400, 32, [10, 0], [385, 40], torch.bfloat16, None, False, "exact", 32, 2,
     dict(heavy=16, observe=8, page_size=8, pages=3)),  # row 1: no bulk; 45 pages: two tiles
    (2, 4, 2, 320, 16, [0, 7], None, torch.float32, 4.0, True, "exact", 16, 3, dict(heavy=8, observe=4, pages=2)),
    (2, 6, 2, 360, 32, None, [360, 333], torch.bfloat16, None, True, "exact", 32, 3, dict(heavy=0, pages=5)),
]

LEAN = [  # the read-lean settings, small: a page hierarchy, local heads over window ∪ E, sizes grown with C
    (2, 4, 2, 600, 16, None, None, torch.float32, None, False, "exact", 16, 3,
     dict(heavy=8, observe=4, pages=3, super_page=4, super_pages=2, attend_exact=True)),
    (2, 6, 2, 520, 32, [0, 60], [500, 513], torch.bfloat16, None, True, "promote", 32, 4,
     dict(heavy=8, observe=4, pages=2, super_page=3, super_pages=3, attend_exact=True, scale_exact=256,
          shrink_exact=False)),  # 12 heavy, 3 pages, 4 super-pages at 520 slots
    (2, 4, 2, 400, 32, [10, 0], [385, 300], torch.float32, 4.0, False, "exact", 32, 2,
     dict(heavy=16, observe=8, page_size=8, pages=3, attend_exact=True)),  # one level, a soft cap
    (2, 4, 2, 360, 16, None, [360, 333], torch.float32, None, True, "exact", 16, 3,
     dict(heavy=0, pages=4, super_page=2, super_pages=3)),  # a hierarchy, window-only
]


def lean_id(case):
    sizes = case[13]
    return "-".join([f"C{case[3]}", str(case[7])[6:], *(name for name in ("attend_exact", "scale_exact")
                                                         if sizes.get(name)),
                     f"S{sizes.get('super_page', 0)}"])


@pytest.mark.parametrize("case", CASES + LEAN, ids=[f"C{c[3]}-d{c[4]}-{str(c[7])[6:]}-cap{c[8]}-{c[10]}-{c[13]}"
                                                     for c in CASES] + [lean_id(c) for c in LEAN])
def test_fused_tail_decision_state_and_output_equal_eager(case):
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, **sizes)
    tau = tail_tau(criterion, step, state, H // H_kv, policy)
    got, (decided, local, read, _, ratio), _ = check_tail(criterion, step, state, tau, policy, block, splits)
    with_bulk = fresh(step).has_bulk
    assert (~read[with_bulk]).any() and read[with_bulk].any()  # not vacuous: some groups skip, some read
    plain = local_ratio(fresh(step).log_local, fresh(step).log_bulk_estimate)
    assert not torch.allclose(ratio[with_bulk], plain[with_bulk])  # the exact set changed the estimate


@pytest.mark.parametrize("case", [CASES[1], CASES[2], LEAN[0], LEAN[1]],
                         ids=["promote", "bf16-two-tiles", "lean", "lean-bf16-scaled"])
def test_decide_once_decides_updates_and_attends_alike(case):
    """``decide_once`` (a decision launch, then the ``triton`` split and combine): the eager decisions and state
    after the step, the unfused output and counts, and the one-launch version's output."""
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, **sizes)
    tau = tail_tau(criterion, step, state, H // H_kv, policy)
    once, _, once_state = check_tail(criterion, step, state, tau, policy, block, splits, decide_once=True)
    one, one_state = fused_tail_launch(criterion, step, state, tau, policy, block, splits)
    for name in ("decided", "local", "read", "broken", "counts", "n_exact", "log_ratio"):
        assert torch.equal(getattr(once, name), getattr(one, name)), name
    torch.testing.assert_close(once.output, one.output, atol=0, rtol=0)
    assert_same_state(once_state, one_state)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=["defaults", "bf16-two-tiles", "no-heavy"])
@pytest.mark.parametrize("pages_per_program", [5, 16])
@pytest.mark.parametrize("decide_once", [True, False], ids=["apart", "in-splits"])
def test_page_bounds_spread_over_programs_decide_alike(monkeypatch, case, pages_per_program, decide_once):
    """With the pages spread over programs of ``pages_per_program`` pages (a page-top launch first), its lists merged
    by the decision launched apart or by every split: the eager decisions, the state after the step, the unfused
    output; and bit for bit what one program per (row, KV head) bounding every page decides."""
    from tests.triton_launches import LaunchRecorder

    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, **sizes)
    tau = tail_tau(criterion, step, state, H // H_kv, policy)
    record = LaunchRecorder(monkeypatch)
    spread, _, spread_state = check_tail(criterion, step, state, tau, policy, block, splits,
                                         decide_once=decide_once, pages_per_program=pages_per_program)
    stretches = -(-state["kmin"].shape[2] // pages_per_program)
    # (called without log E[exp(s)]: its launch, which runs the page-top programs too, then the decision)
    assert stretches > 1 and record.launches[0] == ("bulk_estimate_kernel", (b * H_kv, 1 + stretches))
    assert record.launches[1] == ("qada_tail_fused_split_kernel", (b * H_kv, 1 if decide_once else splits))
    one, one_state = fused_tail_launch(criterion, step, state, tau, policy, block, splits, decide_once=decide_once)
    for name in ("decided", "local", "read", "broken", "counts", "n_exact", "log_ratio"):
        assert torch.equal(getattr(spread, name), getattr(one, name)), name
    torch.testing.assert_close(spread.output, one.output, atol=0, rtol=0)
    assert_same_state(spread_state, one_state)


def test_page_tops_run_alone_where_the_estimate_came_without_them(monkeypatch):
    """``decide_and_attend`` given ``log_mean_exp`` but no ``page_tops`` (a caller whose estimate launch ran none)
    runs the page-top programs in a launch of their own: the same lists, decisions and output bit for bit as when
    the estimate's launch runs them; ``page_tops`` that do not fit the call are refused."""
    from qada.attention.moment_step import estimate_launch
    from tests.triton_launches import LaunchRecorder

    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes = CASES[0]
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, **sizes)
    tau = tail_tau(criterion, step, state, H // H_kv, policy)
    carried, carried_state = fused_tail_launch(criterion, step, state, tau, policy, block, splits,
                                               pages_per_program=5)
    alone_state = copy_state(state)
    tail = fused_tail(criterion, with_state(step, alone_state))
    executor = FusedTritonExecutor(group_policy=policy, block_size=block, num_splits=splits, decide_once=False,
                                   pages_per_program=5)
    log_mean_exp = estimate_launch(executor.bulk_estimate(step.query, step.scale, step.softcap), step.moments)
    record = LaunchRecorder(monkeypatch)
    alone = executor.decide_and_attend(fresh(step), tau, policy, tail, log_mean_exp=log_mean_exp)
    stretches = -(-state["kmin"].shape[2] // 5)
    assert record.launches[:2] == [("qada_tail_page_top_kernel", (b * H_kv, stretches)),
                                   ("qada_tail_fused_split_kernel", (b * H_kv, splits))]
    for name in ("decided", "local", "read", "broken", "counts", "n_exact", "log_ratio", "output"):
        assert torch.equal(getattr(alone, name), getattr(carried, name)), name
    assert_same_state(alone_state, carried_state)
    tops = executor.page_tops(fresh(step), tail)
    with pytest.raises(ValueError, match="log_mean_exp"):
        executor.decide_and_attend(fresh(step), tau, policy, tail, page_tops=tops)
    wider = FusedTritonExecutor(block_size=block, num_splits=splits, pages_per_program=7)
    with pytest.raises(ValueError, match="stretches"):
        wider.decide_and_attend(fresh(step), tau, policy, tail, log_mean_exp=log_mean_exp, page_tops=tops)


@pytest.mark.parametrize("features", [None, 64], ids=["wide", "narrow"])
def test_page_top_programs_bound_wider_tiles_and_decide_alike(monkeypatch, features):
    """The page-top launch bounds its pages in tiles of :func:`~qada.attention.fused.page_top_tile` (the decision
    launched apart and the attending split in tiles of ``page_tiles``' ``BLOCK_P``), and any tile size decides alike:
    with ``features=64`` (4 pages of 16 features a tile, at least 8) each program takes several tiles, and the
    decisions, state and output equal the eager criterion's and the one-program launch's."""
    from qada.attention import _triton_kernel
    from qada.attention import fused as fused_module

    if features is not None:
        monkeypatch.setattr(fused_module, "_PAGE_TOP_TILE_FEATURES", features)
    tiles = []
    run = _triton_kernel.run

    def recording(kernel, grid, *args, **kwargs):
        if "BLOCK_P" in kwargs:
            tiles.append((kernel.fn.__name__, kwargs.get("ATTEND"), kwargs["BLOCK_P"]))
        if kwargs.get("PAGE_TOPS"):  # (the page-top programs the estimate's launch runs)
            tiles.append((kernel.fn.__name__, None, kwargs["PT_BLOCK_P"]))
        return run(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_kernel, "run", recording)
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes = CASES[0]  # 38 pages, d 16
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, **sizes)
    tau = tail_tau(criterion, step, state, H // H_kv, policy)
    spread, _, spread_state = check_tail(criterion, step, state, tau, policy, block, splits, decide_once=True,
                                         pages_per_program=24)
    top = fused_module.page_top_tile(d, 24)
    assert top == (32 if features is None else 8)  # (at most the stretch's power of two; at least 8 pages)
    narrow = fused_module.page_tiles(16, 8, d)["BLOCK_P"]  # (pages of 16 slots, 8 top pages: the defaults)
    assert tiles[:2] == [("bulk_estimate_kernel", None, top), ("qada_tail_fused_split_kernel", False, narrow)]
    one, one_state = fused_tail_launch(criterion, step, state, tau, policy, block, splits, decide_once=True)
    for name in ("decided", "local", "read", "broken", "counts", "n_exact", "log_ratio"):
        assert torch.equal(getattr(spread, name), getattr(one, name)), name
    assert_same_state(spread_state, one_state)


@pytest.mark.parametrize(("pages_per_program", "apart"), [(5, True), (256, False)], ids=["long", "short"])
def test_decide_once_by_default_where_the_pages_are_many(monkeypatch, pages_per_program, apart):
    """``decide_once=None`` (the default): a decision over more pages than ``pages_per_program`` is a launch of its
    own (a page-top launch first), a shorter one is made in every split; the same decisions either way."""
    from tests.triton_launches import LaunchRecorder

    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes = CASES[0]
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, **sizes)
    tau = tail_tau(criterion, step, state, H // H_kv, policy)
    record = LaunchRecorder(monkeypatch)
    check_tail(criterion, step, state, tau, policy, block, splits, decide_once=None,
               pages_per_program=pages_per_program)
    # (called without log E[exp(s)]: its launch first; then check_tail's unfused executor)
    names = [name for name, _ in record.launches][: 4 if apart else 3]
    if apart:  # (the estimate's launch runs the page-top programs too)
        assert names == ["bulk_estimate_kernel", "qada_tail_fused_split_kernel", "qada_decode_split_kernel",
                         "qada_decode_combine_kernel"]
        assert record.launches[1][1] == (b * H_kv, 1)
    else:
        assert names == ["bulk_estimate_kernel", "qada_tail_fused_split_kernel", "qada_decode_combine_kernel"]
        assert record.launches[1][1] == (b * H_kv, splits)
    with pytest.raises(ValueError, match="decide_once"):
        FusedTritonExecutor(decide_once="yes")


def test_the_exact_set_changes_decisions_against_qada():
    """A planted needle in the bulk: ``qada`` (eq. 7 alone) calls the head local, the tail-aware estimate finds
    the needle's page and makes it dense, fused as eagerly."""
    step = make_step(1, 4, 2, 400, 16, None, None, torch.float32, seed=11)
    keys, q = step.keys.clone(), step.query[0, 0]
    target = fresh(step).log_local[0, 0] + 12.0  # head 0's needle, deep in the bulk, e^12 times the window's mass
    keys[0, 0, 200] = target / (step.scale * q.norm()) * q / q.norm()
    step = DecodeStep(step.query, keys, step.scale, step.window, moments=step.moments, values=step.values)
    criterion, state = prepared(step, 5, heavy=0, pages=2)
    eager_decided, *_ = eager_tail(criterion, step, state, 0.3)
    got, _ = fused_tail_launch(criterion, step, state, 0.3)
    plain = local_ratio(fresh(step).log_local, fresh(step).log_bulk_estimate)
    assert plain[0, 0] >= 0.3 and not eager_decided[0, 0] and not got.decided[0, 0]
    assert torch.equal(got.decided, eager_decided)


def test_consecutive_steps_keep_the_state_equal():
    """Four steps on one buffer with a short recent window (6 slots: the step key's page of 16 overlaps the bulk),
    each step's key a needle for the first head of its group: its page must rank with its new extrema. The rows'
    ends advance, row 0's across a page boundary, row 1's in a page empty at the prefill. After each step the fused
    kernel's decisions, ``|E|``, ratios and tail index equal the eager criterion's."""
    window = Window(8, 2)
    step = make_step(2, 4, 2, 300, 16, [0, 5], [254, 270], torch.float32, seed=9, window=window)
    criterion, state = prepared(step, 9, filled=250, heavy=8, observe=4, pages=2)
    first = state
    keys = step.keys.clone()
    for advance in range(4):  # row 0's keys land at slots 253 .. 256 (a fresh page), row 1's at 269 .. 272
        end = step.end + advance
        for r in range(2):
            keys[r, :, end[r] - 1] = 2.5 * step.query[r, ::2]
        now = DecodeStep(step.query, keys, step.scale, window, start=step.start, end=end, moments=step.moments,
                         values=step.values)
        tau = tail_tau(criterion, now, state, 2)
        _, _, state = check_tail(criterion, now, state, tau)
    assert not torch.equal(state["kmin"], first["kmin"])


def test_local_groups_never_read_their_bulk():
    """NaN in the keys and values of the pure-bulk blocks of the groups decided local, outside their exact set,
    never reaches the output; the decision and the output are unchanged."""
    step = make_step(2, 4, 2, 256, 16, None, None, torch.float32, seed=4)
    criterion, state = prepared(step, 4, heavy=8, observe=4, pages=2)
    tau = tail_tau(criterion, step, state, 2)
    clean, _ = fused_tail_launch(criterion, step, state, tau, splits=2)
    assert (~clean.read).any() and clean.read.any()
    *_, eager_step = eager_tail(criterion, step, state, tau)
    _, valid, slots = criterion.exact_set_slots(eager_step)
    keys, values = step.keys.clone(), step.values.clone()
    for r, g in (~clean.read).nonzero().tolist():
        poison = torch.zeros(step.length, dtype=torch.bool)
        poison[32:224] = True  # blocks 2 .. 13 of 16 slots hold bulk tokens only (bulk = [4, 228))
        exact = slots[r, 2 * g : 2 * g + 2][valid[r, 2 * g : 2 * g + 2]]
        poison[exact] = False  # (the decision reads E's keys)
        values[r, g, poison] = float("nan")
        keys[r, g, poison] = float("nan")
    poisoned = DecodeStep(step.query, keys, step.scale, step.window, moments=step.moments, values=values)
    got, _ = fused_tail_launch(criterion, poisoned, state, tau, splits=2)
    assert torch.equal(got.local, clean.local) and torch.isfinite(got.output).all()
    torch.testing.assert_close(got.output, clean.output, atol=0, rtol=0)


def test_fail_safe_forces_non_finite_estimates_dense():
    """A NaN in one KV head's moments: its heads are forced dense and counted, as the eager criterion does."""
    step = make_step(2, 4, 2, 200, 16, None, None, torch.float32, seed=2)
    mean, cov = (t.clone() for t in step.moments)
    mean[0, 1, 3] = float("nan")
    broken = DecodeStep(step.query, step.keys, step.scale, step.window, moments=type(step.moments)(mean, cov),
                        values=step.values)
    criterion, state = prepared(broken, 2, heavy=4, observe=4, pages=1)
    got, (_, _, _, fail_safe, _), _ = check_tail(criterion, broken, state, 0.01)
    assert int(fail_safe) == 2 and got.broken[0, 2:].all() and (~got.decided[0, 2:]).all()


@pytest.mark.parametrize("decide_once", [False, True])
def test_one_split_launch_and_one_combine_without_host_reads(monkeypatch, decide_once):
    """The step's state update, decision and attention: two launches (grid from the shapes; with ``decide_once`` a
    decision launch first, then the ``triton`` executor's two) given each head's ``log E[exp(s)]`` (which a run's
    moment step writes), no host read, only allocations and views."""
    from qada.attention.moment_step import estimate_launch
    from tests.triton_launches import ALLOCATIONS_AND_VIEWS, LaunchRecorder, refusing_host_reads

    step = make_step(2, 4, 2, 150, 16, [0, 9], [150, 130], torch.float32, seed=6)
    criterion, state = prepared(step, 6, heavy=4, observe=4, pages=2)
    tail = FusedTail(*(state[name] for name in STATE), criterion.page_size, criterion.pages)
    executor = FusedTritonExecutor(block_size=16, num_splits=3, decide_once=decide_once)
    estimated = estimate_launch(executor.bulk_estimate(step.query, step.scale, step.softcap), step.moments)
    record = LaunchRecorder(monkeypatch)
    launches = record.launches
    with refusing_host_reads(monkeypatch), record:
        executor.decide_and_attend(step, 0.3, "exact", tail, log_mean_exp=estimated)
    attend = [("qada_decode_split_kernel", (4, 3))] if decide_once else []
    assert launches == [("qada_tail_fused_split_kernel", (4, 1 if decide_once else 3)), *attend,
                        ("qada_decode_combine_kernel", (2 * 4 + 1,))]
    # metadata only: no kernel
    assert set(record.ops) <= ALLOCATIONS_AND_VIEWS, record.ops


@pytest.mark.parametrize("sizes, capped", [(dict(heavy=4, observe=4, pages=2), False),
                                           (dict(heavy=4, observe=4, pages=2, attend_exact=True), True),
                                           (dict(heavy=4, observe=4, pages=2, super_page=2, super_pages=2), True)],
                         ids=["plain", "attend_exact", "hierarchy"])
def test_the_split_launch_caps_registers_where_its_kernel_holds_the_most_state(monkeypatch, sizes, capped):
    """The ``qada_tail`` split kernel with ``attend_exact`` or a page hierarchy, on a 16-bit cache, is launched with a
    register cap that leaves three programs of its warps per SM (168 registers at four warps; head sizes up to 128:
    Triton 3.6 gave it 211-240, two programs), deciding in the splits or apart; the plain one, and every other
    launch, without one; with ``cap_registers=False`` none, the same decisions and output."""
    from qada.attention import _triton_kernel

    caps = []
    run = _triton_kernel.run

    def recording(kernel, grid, *args, **kwargs):
        caps.append((kernel.fn.__name__, kwargs.get("maxnreg")))
        return run(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_kernel, "run", recording)
    step = make_step(2, 4, 2, 150, 16, [0, 9], [150, 130], torch.bfloat16, seed=6)
    criterion, state = prepared(step, 6, **sizes)
    for decide_once in (False, True):
        caps.clear()
        fused_tail_launch(criterion, step, state, 0.3, decide_once=decide_once)
        assert [cap for name, cap in caps if name == "qada_tail_fused_split_kernel"] == [168 if capped else None]
        assert len(caps) > 1 and all(cap is None for name, cap in caps if name != "qada_tail_fused_split_kernel")
    caps.clear()
    uncapped, _ = fused_tail_launch(criterion, step, state, 0.3, cap_registers=False)  # (ptxas chooses)
    assert "qada_tail_fused_split_kernel" in {name for name, _ in caps} and all(cap is None for _, cap in caps)
    capped_launch, _ = fused_tail_launch(criterion, step, state, 0.3)
    assert torch.equal(uncapped.local, capped_launch.local) and torch.equal(uncapped.output, capped_launch.output)
    with pytest.raises(ValueError, match="expected cap_registers to be a bool"):
        FusedTritonExecutor(cap_registers="no")
    tail = fused_tail(criterion, with_state(step, state))
    assert tail.register_cap(torch.bfloat16, 128, 2) == ({"maxnreg": 255} if capped else {})
    assert tail.register_cap(torch.bfloat16, 128, 8) == {}  # (capped at 80, eight warps' programs spilled)
    assert tail.register_cap(torch.bfloat16, 256, 4) == {}  # (two programs per SM there: 255 registers, no cap)
    assert tail.register_cap(torch.float32, 64, 4) == {}  # (capped, a float32 cache's kernel spills)


# --- in a model: the fused run decodes as the unfused one --------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").to(DEVICE)  # on a GPU machine the kernels run compiled, on CUDA


@pytest.fixture(scope="module")
def reference(model):
    from qada.moments.reference import collect_reference_keys

    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    return collect_reference_keys(model, ids, chunk_size=16)


SMALL = {"name": "qada_tail", "tau": 0.3, "heavy": 4, "observe": 4, "page_size": 4, "pages": 2}


def greedy_states(model, run, cache_kind, steps=5):
    """Greedy decoding of two rows (row 1 left-padded), qada attached from the prefill (the criterion sees the
    prompt's queries): ``(tokens [2, steps], summary, the tail index of every layer after every decode step)``."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = (StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 3) if cache_kind == "static"
             else DynamicCache(config=model.config))  # fmt: skip
    states, fused = [], []
    original = LayerStep.__call__

    def spy(self, buffered, *args):
        result = original(self, buffered, *args)
        fused.append(result.output is not None)
        states.append({name: tensor.clone() for name, tensor in args[8]["criterion"].items()})
        return result

    attach(model, run)
    run.reset_stats()
    LayerStep.__call__ = spy
    try:
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        tokens = []
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
        return torch.cat(tokens, 1), run.summary(), states, fused
    finally:
        LayerStep.__call__ = original
        run.remove()


BUDGET = {**SMALL, "name": "qada_tail_budget", "sparsity": 0.5}
BUDGET.pop("tau")
SMALL_LEAN = {**SMALL, "super_page": 2, "super_pages": 2, "attend_exact": True, "scale_exact": 16,
              "shrink_exact": False}  # READ_LEAN's kind of settings, for a cache of 32 slots
BUDGET_LEAN = {**BUDGET, **{k: v for k, v in SMALL_LEAN.items() if k not in SMALL}}


SPREAD = {"pages_per_program": 2}  # (8 pages of 4 slots at 32 slots: 4 page-top programs per (row, KV head))
HEADS_APART = {"decide_once": True, "heads_apart": True}  # the decision launched apart, one program per query head


@pytest.mark.parametrize(("criterion", "source", "cache", "options"), [
    (SMALL, "stored", "static", {}), (SMALL, "current", "dynamic", {}),
    ({"name": "qada_tail", "tau": 0.3}, "stored", "static", {}), (BUDGET, "stored", "static", {}),
    ({**BUDGET, "per_group": True}, "current", "dynamic", {}), (SMALL_LEAN, "stored", "static", {}),
    ({**SMALL_LEAN, "tau": 0.8}, "current", "dynamic", {}), (BUDGET_LEAN, "stored", "static", {}),
    (SMALL, "stored", "static", SPREAD), (SMALL, "current", "dynamic", {**SPREAD, "decide_once": True}),
    (BUDGET, "stored", "static", SPREAD), (SMALL, "stored", "static", HEADS_APART),
    ({**SMALL_LEAN, "tau": 0.8}, "current", "dynamic", HEADS_APART),
    (SMALL, "current", "static", {**SPREAD, **HEADS_APART})],
    ids=["small-stored-static", "small-current-dynamic", "defaults-stored-static", "budget-stored-static",
         "budget-per-group-current-dynamic", "lean-stored-static", "lean-current-dynamic",
         "budget-lean-stored-static", "spread-stored-static", "spread-once-current-dynamic",
         "spread-budget-stored-static", "heads-apart-stored-static", "heads-apart-lean-current-dynamic",
         "heads-apart-spread-current-static"])
def test_model_fused_tail_run_equals_triton_run(monkeypatch, model, reference, criterion, source, cache, options):
    """The fused run decodes as the unfused one: tokens, statistics, the tail index after every layer step. With
    ``options`` spreading the page bounds over page-top programs, the moment step's launch runs them (grid
    ``(pairs, 1 + stretches)``) and no page-top launch of their own is made; with ``heads_apart`` the decision
    launch runs one program per query head (grid ``(pairs, G)``) and the split applies the group policy."""
    from tests.triton_launches import LaunchRecorder

    unfused = greedy_states(model, make_run(source, {"name": "triton", "block_size": 16}, reference, criterion), cache)
    record = LaunchRecorder(monkeypatch)
    fused = greedy_states(model, make_run(source, {"name": "triton_fused", "block_size": 16, **options}, reference,
                                          criterion), cache)  # fmt: skip
    moment_grids = {grid for name, grid in record.launches if name.endswith("moment_step_kernel")}
    assert "qada_tail_page_top_kernel" not in {name for name, _ in record.launches}
    pairs = 2 * model.config.num_key_value_heads
    if options.get("heads_apart"):
        G = model.config.num_attention_heads // model.config.num_key_value_heads
        assert ("qada_tail_fused_split_kernel", (pairs, G)) in record.launches
    if "pages_per_program" in options:  # (1 + the tail index's pages over 2: 8 or more pages)
        assert moment_grids and all(len(grid) == 2 and grid[0] == pairs and grid[1] >= 5 for grid in moment_grids)
    else:
        assert moment_grids == {(pairs,)}
    assert fused[3] and all(fused[3]) and not any(unfused[3])  # every decode step decided in the kernel
    assert torch.equal(fused[0], unfused[0])
    for key in ("sparsity", "kv_sparsity", "kv_read"):
        assert fused[1][key] == pytest.approx(unfused[1][key], abs=1e-12), key
    assert fused[1]["fail_safe"] == unfused[1]["fail_safe"] and fused[1]["decode_steps"] == unfused[1]["decode_steps"]
    assert len(fused[2]) == len(unfused[2])
    # With attend_exact the combine merges E as one more split, the unfused step after it: layer l's output rounds
    # differently, so layer l+1's keys (and the tail index built from them) differ by float rounding; layer 0's
    # index is bit for bit, and the decisions above are the same
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if criterion.get("attend_exact") else {"atol": 0, "rtol": 0}
    for step, (got, expected) in enumerate(zip(fused[2], unfused[2], strict=True)):  # the index after every layer step
        assert got.keys() == expected.keys()
        exact = step % model.config.num_hidden_layers == 0
        for name in got:
            torch.testing.assert_close(got[name], expected[name], equal_nan=True, msg=name,
                                       **({"atol": 0, "rtol": 0} if exact else tolerance))
    if criterion.get("heavy") == SMALL["heavy"] and "per_group" not in criterion:
        assert 0.0 < fused[1]["kv_sparsity"] < 1.0  # not vacuous: some groups skip their bulk, some read it


@pytest.mark.parametrize("criterion", [
    {"name": "quest", "pages": 2},
    {"name": "any_of", "criteria": [{"name": "qada_tail", "tau": 0.3}, {"name": "local"}]},
], ids=["quest", "any_of"])
def test_model_unfused_configurations_are_errors(reference, criterion):
    """Said when the run is built, before any work."""
    with pytest.raises(ValueError, match="plain 'qada' criterion, or of 'qada_budget', 'qada_tail'.*use the 'triton' "
                                         "executor"):
        make_run("stored", "triton_fused", reference, criterion=criterion)


# --- the kernel compiles for the GPU (no GPU needed) -----------------------------------------------------------

COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qada.attention import _fused_tail_kernel as K

    for dtype, rows, features, lean, decide in (("bf16", True, True, False, False),
                                                ("fp32", False, False, False, False),
                                                ("bf16", True, False, True, False), ("bf16", True, False, True, True)):
        pointers = dict(Q="*" + dtype, K="*" + dtype, V="*" + dtype, LME="*fp32",
                        START="*i64" if rows else "*" + dtype, END="*i64" if rows else "*" + dtype,
                        SINKS="*fp32" if features else "*" + dtype,
                        HEAVY="*i64", HEAVY_VALID="*u8", MEMBER="*u8", KMIN="*" + dtype, KMAX="*" + dtype,
                        HALVES="*fp32",
                        ACC="*fp32", M="*fp32", L="*fp32", COUNTS="*i32", DECIDED="*u8", LOCAL="*u8", READ="*u8",
                        BROKEN="*u8", LOG_RATIO="*fp32", N_EXACT="*i32", CAND_VALS="*fp32", CAND_IDS="*i32",
                        CAND_OKS="*i32", SUPER_KMIN="*" + dtype, SUPER_KMAX="*" + dtype, SUPER_HALVES="*fp32",
                        EXTRA_M="*fp32", EXTRA_L="*fp32", EXTRA_ACC="*fp32")
        constants = dict(G=4, D=128, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, BLOCK_H=32,
                         BLOCK_P=32, PAGE=16, BLOCK_S=16, TOP=8, BLOCK_M=8, ENTRIES=2, HAS_START=rows, HAS_END=rows,
                         HAS_SINKS=features, PROMOTE=features, INPUT_PRECISION="ieee" if dtype == "fp32" else None,
                         DOT_FP32=False, SOFTCAP=features, ATTEND=not (features or decide), SCORE=features,
                         CANDIDATES=features, PDL=not features, SUPER=16 if lean else 0, SUPER_TOP=4 if lean else 1,
                         BLOCK_SM=4 if lean else 2, EXACT=lean, TOKEN_STAGES=2, HEADS_APART=features or decide)
        floats = {n: "fp32" for n in ("scale", "qk_scale", "softcap", "log_tau")}
        for kernel in (K.qada_tail_fused_split_kernel, K.qada_tail_page_top_kernel):
            names = kernel.arg_names
            signature = {n: pointers.get(n, "constexpr" if n in constants else floats.get(n, "i32")) for n in names}
            source = ASTSource(kernel, signature, constexprs={(names.index(n),): c for n, c in constants.items()
                                                              if n in names})
            triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    print("compiled")
    """
)


def test_fused_tail_kernel_compiles_for_the_gpu():
    """The ``qada_tail`` split kernel compiles (TTIR .. cubin) for sm_90 without a GPU, at the benchmarks' sizes
    (32 heavy tokens, 8 pages of 16): with bfloat16 inputs (and page extrema), rows, a soft cap, sink logits and
    ``promote`` in the budget's score mode (no attention) merging page lists, one program per query head, and with
    float32 inputs and none of them, attending; with a page hierarchy (super-pages of 16 pages) and
    ``attend_exact``, attending and deciding apart one program per query head; and the page-top kernel alike."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
