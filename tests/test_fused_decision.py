"""The ``triton_fused`` executor: the ``qada`` decision (eqs. 5-7) in the split kernel, against the eager criterion
and the unfused ``triton`` executor. On CPU the kernels run in Triton's interpreter (slow: small shapes only)."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import textwrap
import warnings

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from tiny_models import tiny_model  # noqa: E402
from transformers import DynamicCache, StaticCache  # noqa: E402

from qada.attention import EXECUTORS, FusedTritonExecutor, apply_group_policy  # noqa: E402
from qada.attention.base import GroupDecision  # noqa: E402
from qada.criteria import QAdACriterion  # noqa: E402
from qada.functional import local_ratio  # noqa: E402
from qada.models import attach, build_run  # noqa: E402
from qada.models.layer_step import LayerStep  # noqa: E402
from qada.models.step_parts import statistics_row  # noqa: E402
from qada.moments import StoredMoments  # noqa: E402
from qada.moments.reference import collect_reference_keys  # noqa: E402
from qada.step import BulkMoments, DecodeStep  # noqa: E402
from qada.window import Window  # noqa: E402
from tests.test_attention_triton import DEVICE, TOLERANCE, hand_blocks  # noqa: E402

WINDOW = Window(32, 4)


def bulk_moments(k, starts, ends, window, dtype=torch.float32):
    """Mean and population covariance of each row's bulk keys (the moments a perfect source would give)."""
    b, H_kv, C, d = k.shape
    mean, cov = torch.zeros(b, H_kv, d, dtype=dtype), torch.zeros(b, H_kv, d, d, dtype=dtype)
    for r in range(b):
        first = 0 if starts is None else starts[r]
        last = C if ends is None else ends[r]
        t_bulk = max(0, last - first - window.t_local)
        if t_bulk < 2:
            continue
        keys = k[r, :, first + window.t_sink : first + window.t_sink + t_bulk].float()
        centred = keys - keys.mean(1, keepdim=True)
        mean[r] = keys.mean(1).to(dtype)
        cov[r] = (centred.transpose(1, 2) @ centred / t_bulk).to(dtype)
    return mean, cov


def make_step(b, H, H_kv, C, d, starts, ends, dtype, seed, softcap=None, sinks=False, window=WINDOW):
    """A decode step with random q, k, v (some query heads aligned with their sinks, so that they are local) and
    the bulk's own moments."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, d, generator=g)
    k = torch.randn(b, H_kv, C, d, generator=g) * 1.5
    v = torch.randn(b, H_kv, C, d, generator=g)
    G = H // H_kv
    for r in range(b):  # heads 0 of every group: the query points at the row's first sink key
        first = 0 if starts is None else starts[r]
        q[r, ::G] += 0.6 * k[r, :, first]
    mean, cov = bulk_moments(k, starts, ends, window)
    sink_logits = torch.randn(H, generator=g) + 3.0 if sinks else None  # about the window's mass
    rows = [None if x is None else torch.tensor(x, device=DEVICE) for x in (starts, ends)]
    return DecodeStep(q.to(DEVICE, dtype), k.to(DEVICE, dtype), d**-0.5, window, start=rows[0], end=rows[1],
                      moments=BulkMoments(mean.to(DEVICE), cov.to(DEVICE)), values=v.to(DEVICE, dtype),
                      sink_logits=None if sink_logits is None else sink_logits.to(DEVICE), softcap=softcap)


def fresh(step):
    """A copy of ``step`` without its cached derived values."""
    return DecodeStep(step.query, step.keys, step.scale, step.window, start=step.start, end=step.end,
                      moments=step.moments, values=step.values, sink_logits=step.sink_logits, softcap=step.softcap)


def eager(step, tau, policy="exact"):
    """The eager ``qada`` criterion and group policy: ``(decided, local, read, fail_safe, ratio)``."""
    step = fresh(step)
    decided = QAdACriterion(tau).decide(step)
    local, read = apply_group_policy(decided, step.has_bulk, step.num_kv_heads, policy)
    fail_safe = torch.zeros((), dtype=torch.long) if step.fail_safe is None else step.fail_safe
    return decided, local, read, fail_safe, local_ratio(step.log_local, step.log_bulk_estimate)


def tau_between(ratio, has_bulk, G):
    """A threshold halfway between two neighbouring ratios, near the median of the groups' smallest ratios (about
    half of the groups all local), and far (relative 1e-3) from every ratio: the decisions cannot hinge on rounding."""
    H_kv = ratio.shape[1] // G
    values = ratio[has_bulk].flatten().double().sort().values.tolist()
    group_min = ratio.view(-1, H_kv, G).amin(-1)[has_bulk].flatten().double().sort().values.tolist()
    target = group_min[len(group_min) // 2]
    gaps = [(abs((x + y) / 2 - target), (x + y) / 2) for x, y in zip(values, values[1:], strict=False)
            if y - x > 2e-3 * max(y, 1e-30)]  # fmt: skip
    return min(gaps)[1]


def check_fused(step, tau, policy="exact", block=16, splits=3, decide_once=False, estimate_in_splits=False):
    """The fused launch against the eager criterion (decisions, fail-safe), the unfused ``triton`` executor on the
    eager decision (output) and the block counts of :func:`hand_blocks` (local groups skip their bulk blocks)."""
    decided, local, read, fail_safe, ratio = eager(step, tau, policy)
    executor = FusedTritonExecutor(group_policy=policy, block_size=block, num_splits=splits, decide_once=decide_once,
                                   estimate_in_splits=estimate_in_splits)
    sums = torch.rand(3, 5, dtype=torch.float64, device=DEVICE)  # a run's statistics sums: the step adds its row at 1
    before = sums.clone()
    got = executor.decide_and_attend(fresh(step), tau, policy, add_to=(sums, torch.tensor(1, device=DEVICE)))
    assert torch.equal(sums[[0, 2]], before[[0, 2]]) and torch.equal(sums[1], before[1] + got.row)
    near = (ratio - tau).abs() <= 1e-4 * tau  # rounding may decide these either way (none with tau_between)
    assert torch.equal(got.decided | near, decided | near) and torch.equal(got.decided & ~near, decided & ~near)
    if not near.any():
        assert torch.equal(got.decided, decided) and torch.equal(got.local, local) and torch.equal(got.read, read)
    assert int(got.broken.sum()) == int(fail_safe)
    expected_row = statistics_row(fresh(step), got.local, got.read, got.broken, QAdACriterion(tau))
    assert torch.equal(got.row, expected_row), (got.row, expected_row)  # the combine's statistics: exact
    unfused = EXECUTORS.build("triton", group_policy=policy, block_size=block, num_splits=splits)
    expected = unfused.launch(fresh(step), GroupDecision(got.local, got.read))
    atol, rtol = TOLERANCE[step.query.dtype]
    assert got.output.shape == (*step.query.shape[:2], 1, step.head_dim) and got.output.dtype == step.query.dtype
    torch.testing.assert_close(got.output.float(), expected.output.float(), atol=atol, rtol=rtol)
    reference = EXECUTORS.build("reference", group_policy=policy)
    ref_out, _ = reference.attend(fresh(step), GroupDecision(got.local, got.read))
    torch.testing.assert_close(got.output.float(), ref_out.float(), atol=atol, rtol=rtol)
    starts = None if step.start is None else step.start.tolist()
    ends = None if step.end is None else step.end.tolist()
    loaded, bulk_only = hand_blocks(step.length, block, starts, ends, got.local.cpu(), step.num_kv_heads, step.window)
    assert got.bulk_blocks.item() == bulk_only and got.counts[..., 1].sum().item() == loaded
    assert torch.equal(got.counts, expected.counts)
    return got, (decided, local, read, fail_safe, ratio)


CASES = [  # (b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits)
    (2, 4, 2, 400, 16, None, None, torch.float32, None, False, "exact", 16, 3),
    (2, 6, 2, 520, 32, [0, 60], [500, 520], torch.float32, None, False, "promote", 32, 4),
    (2, 4, 2, 300, 32, [10, 0], [290, 40], torch.bfloat16, None, False, "exact", 32, 2),  # row 1: no bulk
    (2, 4, 2, 320, 16, [0, 7], None, torch.float32, 4.0, True, "exact", 16, 3),  # soft cap, sink logits
    (2, 6, 2, 360, 32, None, [360, 333], torch.bfloat16, 3.0, True, "promote", 32, 3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C{c[3]}-d{c[4]}-{str(c[7])[6:]}-cap{c[8]}-sinks{c[9]}-{c[10]}")
def test_fused_decision_and_output_equal_eager(case):
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    _, _, _, _, ratio = eager(step, 0.5, policy)
    tau = tau_between(ratio, fresh(step).has_bulk, H // H_kv)
    got, (decided, local, read, _, _) = check_fused(step, tau, policy, block, splits)
    with_bulk = fresh(step).has_bulk
    assert (~read[with_bulk]).any() and read[with_bulk].any()  # not vacuous: some groups skip, some read
    assert (~decided).any()


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=["promote", "softcap-sinks"])
def test_decide_once_decides_and_attends_alike(case):
    """``decide_once``: the decision made once per group by the launch that writes each head's ``log E[exp(s)]``,
    then the ``triton`` split and combine on its mask: the eager decisions, the unfused output and block counts, and
    bit for bit the decisions and output of the splits that decide."""
    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits = case
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    _, _, _, _, ratio = eager(step, 0.5, policy)
    tau = tau_between(ratio, fresh(step).has_bulk, H // H_kv)
    once, _ = check_fused(step, tau, policy, block, splits, decide_once=True)
    one = FusedTritonExecutor(group_policy=policy, block_size=block, num_splits=splits).decide_and_attend(
        fresh(step), tau, policy)
    for name in ("decided", "local", "read", "broken", "counts"):
        assert torch.equal(getattr(once, name), getattr(one, name)), name
    torch.testing.assert_close(once.output, one.output, atol=0, rtol=0)


@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_extreme_thresholds(tau):
    """``tau = 0``: every head local (log tau = -inf); ``tau = 1``: every head of a row with a bulk dense."""
    step = make_step(2, 4, 2, 200, 16, [0, 150], None, torch.float32, seed=1)
    got, _ = check_fused(step, tau)
    with_bulk = fresh(step).has_bulk
    assert got.decided.all() if tau == 0 else (~got.decided[with_bulk]).all() and got.decided[~with_bulk].all()


def test_local_groups_never_read_their_bulk():
    """NaN in the pure-bulk blocks (keys and values) of the groups the kernel decided local never reaches the
    output; the same poison in a group that reads its bulk does."""
    step = make_step(2, 4, 2, 256, 16, None, None, torch.float32, seed=4)
    _, _, _, _, ratio = eager(step, 0.5)
    tau = tau_between(ratio, fresh(step).has_bulk, 2)
    executor = FusedTritonExecutor(block_size=16, num_splits=2)
    clean = executor.decide_and_attend(fresh(step), tau)
    assert (~clean.read).any() and clean.read.any()
    keys, values = step.keys.clone(), step.values.clone()
    pure_bulk = slice(32, 224)  # blocks 2 .. 13 of 16 slots hold bulk tokens only (bulk = [4, 228))
    for r, g in (~clean.read).nonzero().tolist():
        keys[r, g, pure_bulk] = float("nan")
        values[r, g, pure_bulk] = float("nan")
    poisoned = DecodeStep(step.query, keys, step.scale, step.window, moments=step.moments, values=values)
    got = executor.decide_and_attend(poisoned, tau)
    assert torch.equal(got.local, clean.local) and torch.isfinite(got.output).all()
    torch.testing.assert_close(got.output, clean.output, atol=0, rtol=0)
    r, g = clean.read.nonzero()[0].tolist()
    keys[r, g, pure_bulk] = float("nan")
    got = executor.decide_and_attend(DecodeStep(step.query, keys, step.scale, step.window, moments=step.moments,
                                                values=values), tau)
    assert got.output[r, g * 2 : g * 2 + 2][~got.local[r, g * 2 : g * 2 + 2]].isnan().all()


def test_fail_safe_forces_non_finite_estimates_dense():
    """A NaN in one KV head's moments (row 0) and an overflowing covariance (row 1): those heads are forced dense
    and counted, as the eager criterion does."""
    step = make_step(2, 4, 2, 200, 16, None, None, torch.float32, seed=2)
    mean, cov = (t.clone() for t in step.moments)
    mean[0, 1, 3] = float("nan")
    cov[1, 0] *= 1e38
    broken = DecodeStep(step.query, step.keys, step.scale, step.window, moments=BulkMoments(mean, cov),
                        values=step.values)
    got, (decided, _, _, fail_safe, _) = check_fused(broken, 0.01)
    assert int(fail_safe) == 4 and (~got.decided[0, 2:]).all() and (~got.decided[1, :2]).all()
    assert got.broken[0, 2:].all() and got.broken[1, :2].all() and int(got.broken.sum()) == 4


@pytest.mark.parametrize("decide_once", [False, True])
def test_one_split_launch_and_one_combine_without_host_reads(monkeypatch, decide_once):
    """The step's decision and attention given each head's ``log E[exp(s)]`` (which a run's moment step writes): two
    launches (grid from the shapes); with ``decide_once`` the decision is made once per group by the launch that
    writes the estimate (here one of its own: a run's moment step makes it), then the ``triton`` executor's two. No
    host read, only allocations."""
    from qada.attention.moment_step import estimate_launch
    from tests.triton_launches import ALLOCATIONS_AND_VIEWS, LaunchRecorder, refusing_host_reads

    step = make_step(2, 4, 2, 150, 16, [0, 9], [150, 130], torch.float32, seed=6)
    executor = FusedTritonExecutor(block_size=16, num_splits=3, decide_once=decide_once)
    estimated = estimate_launch(executor.bulk_estimate(step.query, step.scale, step.softcap), step.moments)
    record = LaunchRecorder(monkeypatch)
    launches = record.launches
    with refusing_host_reads(monkeypatch), record:
        executor.decide_and_attend(step, 0.3, log_mean_exp=estimated)
    split = [("bulk_estimate_kernel", (4,)), ("qada_decode_split_kernel", (4, 3))] if decide_once else [
        ("qada_fused_split_kernel", (4, 3))]
    assert launches == [*split, ("qada_decode_combine_kernel", (2 * 4 + 1,))]
    # metadata only: no kernel
    assert set(record.ops) <= ALLOCATIONS_AND_VIEWS, record.ops


def test_a_decision_made_with_the_estimate_needs_decide_once():
    """An :class:`~qada.attention.moment_step.EstimateDecision` is what the estimate's launch decides with
    ``decide_once``; given to an executor that decides in its splits, it is an error, not ignored."""
    step = make_step(1, 4, 2, 60, 16, None, None, torch.float32, seed=3)
    executor = FusedTritonExecutor(block_size=16, num_splits=2)
    made = executor.estimate_decision(step.query, step.keys, None, None, None, 0.5, "exact", step.window)
    with pytest.raises(ValueError, match="decide_once=True"):
        executor.decide_and_attend(step, 0.5, decision=made)


def test_plain_executor_call_is_the_triton_executor():
    """Called with a decision (outside a run), ``triton_fused`` attends as ``triton`` does."""
    step = make_step(1, 4, 2, 100, 16, None, None, torch.float32, seed=3)
    decision = GroupDecision(torch.tensor([[True, True, False, True]], device=DEVICE),
                             torch.tensor([[False, True]], device=DEVICE))
    got = EXECUTORS.build("triton_fused", block_size=16).attend(fresh(step), decision)
    expected = EXECUTORS.build("triton", block_size=16).attend(fresh(step), decision)
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    assert got[1].item() == expected[1].item()


# --- in a model: the fused run decodes as the unfused one --------------------------------------------------------

MODEL_WINDOW = {"t_local": 8, "t_sink": 2}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").to(DEVICE)  # on a GPU machine the kernels run compiled, on CUDA


@pytest.fixture(scope="module")
def reference(model):
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    return collect_reference_keys(model, ids, chunk_size=16)


def make_run(source, executor, reference, criterion=None, compile=None):
    if source == "stored":
        source = StoredMoments(offset=12, min_bulk_keys=4)
        source.set_reference(reference)
    return build_run(criterion=criterion or {"name": "qada", "tau": 0.3}, moments=source, executor=executor,
                     window=MODEL_WINDOW, compile=compile)


def greedy(model, run, cache_kind, steps=6):
    """Greedy decoding of two rows (row 1 left-padded): ``(tokens [2, steps], summary)``."""
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = (StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 3) if cache_kind == "static"
             else DynamicCache(config=model.config))  # fmt: skip
    attach(model, run)
    run.reset_stats()
    try:
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        tokens = []
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
        return torch.cat(tokens, 1), run.summary()
    finally:
        run.remove()


@contextlib.contextmanager
def fused_steps(counter):
    """Count the layer steps that decided in the kernel."""
    original = LayerStep.__call__

    def spy(self, buffered, *args):
        result = original(self, buffered, *args)
        counter.append(result.output is not None)
        return result

    LayerStep.__call__ = spy
    try:
        yield
    finally:
        LayerStep.__call__ = original


@pytest.mark.parametrize(("source", "cache", "decide_once"),
                         [("stored", "static", False), ("current", "dynamic", False), ("stored", "static", True),
                          ("current", "static", True)])
def test_model_fused_run_equals_triton_run(model, reference, source, cache, decide_once):
    unfused = greedy(model, make_run(source, {"name": "triton", "block_size": 16}, reference), cache)
    calls: list = []
    with fused_steps(calls):
        executor = {"name": "triton_fused", "block_size": 16, "decide_once": decide_once}
        fused = greedy(model, make_run(source, executor, reference), cache)
    assert calls and all(calls)  # every decode step decided in the kernel
    assert torch.equal(fused[0], unfused[0])
    for key in ("sparsity", "kv_sparsity", "kv_read"):
        assert fused[1][key] == pytest.approx(unfused[1][key], abs=1e-12), key
    assert fused[1]["fail_safe"] == unfused[1]["fail_safe"] and fused[1]["decode_steps"] == unfused[1]["decode_steps"]
    assert 0.0 < fused[1]["kv_sparsity"] < 1.0  # not vacuous: some groups skip their bulk, some read it


@pytest.mark.parametrize(("source", "criterion", "decide_once"),
                         [("stored", "qada", False), ("current", "qada", False), ("stored", "qada", True),
                          ("stored", "qada_tail", False), ("current", "qada_tail", True),
                          ("stored", "qada_tail_budget", False),
                          ("current", "qada_tail_budget_per_group", False),
                          ("stored", "qada_budget", True), ("current", "qada_budget_per_group", False)])
def test_model_layer_step_is_three_launches_and_nothing_else(monkeypatch, model, reference, source, criterion,
                                                              decide_once):
    """A decode step of a layer with ``triton_fused``: the moment step, the fused split and the combine (with
    ``decide_once`` the plain ``qada`` decision made by the moment step's launch, then the ``triton`` split: three;
    a ``qada_tail`` decision and the ``triton`` split apart: four; a budget's scores, its ranking, then the
    ``triton`` split and combine: five), no other torch operation than allocations and views (the statistics row
    comes from the combine, a budget's count from the layer's state), no host read; what a CUDA graph replays per
    layer."""
    from tests.triton_launches import LaunchRecorder, fused_step_launches, refusing_host_reads

    record = LaunchRecorder(monkeypatch)
    steps: list = []
    original = LayerStep.__call__

    def recorded(self, buffered, *args):
        ops, launches = len(record.ops), len(record.launches)
        with refusing_host_reads(monkeypatch), record:
            result = original(self, buffered, *args)
        steps.append((record.ops[ops:], [name for name, _ in record.launches[launches:]]))
        return result

    monkeypatch.setattr(LayerStep, "__call__", recorded)
    executor = {"name": "triton_fused", "block_size": 16, "decide_once": decide_once}
    config = {"name": criterion, "tau": 0.3}
    if criterion.startswith(("qada_tail_budget", "qada_budget")):
        name = "qada_tail_budget" if criterion.startswith("qada_tail") else "qada_budget"
        config = {"name": name, "sparsity": 0.5, "per_group": criterion.endswith("per_group")}
    greedy(model, make_run(source, executor, reference, criterion=config), "static", steps=2)
    expected = fused_step_launches(source, criterion, decide_once)
    assert len(steps) == 2 * model.config.num_hidden_layers
    views = {"aten.view.dtype", "aten.select.int", "aten.detach.default", "aten.unsqueeze.default",
             "aten.view.default", "aten.slice.Tensor", "aten.expand.default", "aten.alias.default"}  # no kernel
    for ops, launches in steps:
        assert launches == expected
        assert set(ops) <= {"aten.empty.memory_format"} | views, sorted(set(ops))


def test_dispatch_count_benchmark_counts_the_fused_step(model, reference):
    """``benchmarks/dispatch_count.py``'s counter on the tiny model: the fused run launches three kernels per layer and
    dispatches about as many operations as the unwrapped model; the unfused ``triton`` run dozens more per layer."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.dispatch_count import count_step

    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    layers = model.config.num_hidden_layers
    dense = count_step(model, None, ids, extra=4)
    fused = count_step(model, make_run("stored", {"name": "triton_fused", "block_size": 16}, reference), ids, 4)
    unfused = count_step(model, make_run("stored", {"name": "triton", "block_size": 16}, reference), ids, 4)
    assert dense["launches"] == 0 and fused["launches"] == 3 * layers and unfused["launches"] == 2 * layers
    assert fused["by_launch"] == {"stored_moment_step_kernel": layers, "qada_fused_split_kernel": layers,
                                  "qada_decode_combine_kernel": layers}
    assert abs(fused["device_ops"] - dense["device_ops"]) <= 6 * layers
    assert unfused["device_ops"] - dense["device_ops"] > 30 * layers


def test_model_other_criterion_is_an_error(model, reference):
    """Said when the run is built, before any work."""
    with pytest.raises(ValueError, match="plain 'qada' criterion.*use the 'triton' executor"):
        make_run("stored", "triton_fused", reference, criterion={"name": "oracle", "tau": 0.3})


# --- the kernel compiles for the GPU (no GPU needed) -----------------------------------------------------------

COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qada.attention import _fused_kernel as K

    kernel = K.qada_fused_split_kernel
    for dtype, rows, features in (("bf16", True, True), ("fp32", False, False)):
        pointers = dict(Q="*" + dtype, K="*" + dtype, V="*" + dtype, LME="*fp32",
                        START="*i64" if rows else "*" + dtype, END="*i64" if rows else "*" + dtype,
                        SINKS="*fp32" if features else "*" + dtype,
                        ACC="*fp32", M="*fp32", L="*fp32", COUNTS="*i32", DECIDED="*u8", LOCAL="*u8", READ="*u8",
                        BROKEN="*u8", MEAN="*fp32", COV="*fp32", GH_X="*fp32", GH_LOGW="*fp32")
        constants = dict(G=4, D=128, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, HAS_START=rows,
                         HAS_END=rows, HAS_SINKS=features, PROMOTE=features,
                         INPUT_PRECISION="ieee" if dtype == "fp32" else None, DOT_FP32=False, SOFTCAP=features,
                         PDL=features, ESTIMATE=features, BLOCK_T=32, BLOCK_E=4, BLOCK_X=16)
        floats = {n: "fp32" for n in ("scale", "qk_scale", "softcap", "log_tau")}
        names = kernel.arg_names
        signature = {n: pointers.get(n, "constexpr" if n in constants else floats.get(n, "i32")) for n in names}
        source = ASTSource(kernel, signature, constexprs={(names.index(n),): c for n, c in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    print("compiled")
    """
)


def test_fused_kernel_compiles_for_the_gpu():
    """The fused split kernel compiles (TTIR .. cubin) for sm_90 without a GPU: with bfloat16 inputs, rows, a soft
    cap, sink logits, ``promote`` and the estimate in the split, and with float32 inputs and none of them."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_hermite_rule_matches_the_eager_capped_estimate():
    """(Guards the constants the kernel reads under a soft cap.)"""
    from qada.attention.triton_decode import _hermite
    from qada.functional.capping import capped_log_mean_exp

    x, log_w = _hermite(torch.device("cpu"))
    mu, var, c = torch.tensor([0.3]), torch.tensor([2.0]), 3.0
    s = mu[:, None] + math.sqrt(2.0) * var.sqrt()[:, None] * x
    mine = torch.logsumexp(log_w + c * torch.tanh(s / c), -1)
    torch.testing.assert_close(mine, capped_log_mean_exp(mu, var, c))


def test_prefill_holds_the_executors_constants_on_the_device(model, reference):
    """A run's prefill (eager) gives ``triton_fused`` its soft-cap constants on the cache's device, so that a
    compiled decode step reads them as inputs instead of making them from host data at every call."""
    run = make_run("stored", {"name": "triton_fused", "block_size": 16}, reference)
    assert run.executor._hermite_held is None
    greedy(model, run, "static", steps=1)
    nodes, log_weights = run.executor._hermite_held
    assert nodes.device == log_weights.device == next(model.parameters()).device and nodes.shape == log_weights.shape
    assert run.executor.hermite_rule(nodes.device)[0] is nodes  # held: not made again
    greedy(model, run, "static", steps=1)  # a new sequence: the same tensors (a recorded CUDA graph reads them)
    assert run.executor._hermite_held[0] is nodes and run.executor._hermite_held[1] is log_weights


def _recorded_steps(model, reference, criterion, executor, steps=2):
    """The layer-step calls of an eager greedy decode (:func:`greedy`) of the fused path, as recorded by
    :func:`tests.step_replay.recording_layer_steps`."""
    from tests.step_replay import recording_layer_steps

    run = make_run("stored", executor, reference, criterion, compile=False)
    with recording_layer_steps() as calls, torch.no_grad():
        greedy(model, run, "static", steps=steps)
    return calls


def test_replayed_layer_steps_agree_with_themselves_and_name_a_difference(model, reference):
    """The replay that tells a compiled step's difference from the harness's (:mod:`tests.step_replay`): the eager
    fused step against itself on identical copies of every recorded call agrees; against the same step at another
    ``tau`` it names the first call and the result fields that differ."""
    import functools

    from qada.criteria import QAdACriterion
    from qada.models.fused_step import fused_layer_step
    from tests.step_replay import replay

    calls = _recorded_steps(model, reference, {"name": "qada", "tau": 0.3}, {"name": "triton_fused",
                                                                             "block_size": 16})  # fmt: skip
    assert len(calls) == 2 * model.config.num_hidden_layers  # two decode steps (the prefill makes no layer step)
    eager = lambda step, args: step.eager(*args)  # noqa: E731
    assert replay(calls, eager, eager) == []

    def other_tau(step, args):
        bound = dict(step._bound, executor=step.fused, criterion=QAdACriterion(tau=0.999))
        return functools.partial(fused_layer_step, **bound)(*args)

    found = replay(calls, eager, other_tau)
    assert found and all(line.startswith("call ") for line in found)
    assert any("result.local" in line for line in found), found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("criterion", [{"name": "qada", "tau": 0.3}, {"name": "qada_tail", "tau": 0.3}],
                         ids=["qada", "qada_tail"])
def test_gpu_compiled_fused_step_equals_eager_on_the_same_inputs(model, reference, criterion):
    """On a GPU the compiled fused step (``compile_step=True``) against the eager one on identical copies of every
    layer-step call of an eager decode: the same results and the same states after each call. Where the test
    below fails (other statistics over a decode) and this passes, the difference is in the harness around the step,
    not in the compiled step; where this fails, its message names the first call and field that differ."""
    from qada.models.fused_step import fused_layer_step
    from qada.models.layer_step import compile_layer_step
    from tests.step_replay import replay

    executor = {"name": "triton_fused", "block_size": 16, "compile_step": True}
    calls = _recorded_steps(model, reference, criterion, executor, steps=6)
    step = calls[0][0]
    torch._dynamo.reset()
    compiled = compile_layer_step(dict(step._bound, executor=step.fused), "inductor", fused_layer_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        found = replay(calls, lambda step, args: step.eager(*args), lambda step, args: compiled(*args))
    assert found == []


def _eager_launch(kernel, grid, args, kwargs):
    """A recorded launch made eagerly (Triton's own launcher; the interpreter without a GPU)."""
    from qada.attention import _triton_kernel

    _triton_kernel._launch(kernel, grid, *args, **kwargs)


def test_replayed_launches_agree_with_themselves_and_name_a_difference(model, reference):
    """The launch-level replay (:func:`tests.step_replay.replay_launches`): the launches of an eager fused decode
    step (three per layer) made twice eagerly agree; a launcher that makes the split kernel decide at another
    ``tau`` is named, with the launch, the kernel and the flags it wrote otherwise."""
    from tests.step_replay import recording_launches, replay_launches

    run = make_run("stored", {"name": "triton_fused", "block_size": 16}, reference, {"name": "qada", "tau": 0.3},
                   compile=False)
    with recording_launches() as launches, torch.no_grad():
        greedy(model, run, "static", steps=1)
    names = [kernel.fn.__name__ for kernel, *_ in launches]
    assert names == ["stored_moment_step_kernel", "qada_fused_split_kernel",
                     "qada_decode_combine_kernel"] * model.config.num_hidden_layers  # fmt: skip
    assert replay_launches(launches, _eager_launch, _eager_launch) == []

    def other_tau(kernel, grid, args, kwargs):  # the split kernel's log_tau
        if kernel.fn.__name__ == "qada_fused_split_kernel":
            at = kernel.arg_names.index("log_tau")
            args = (*args[:at], math.log(0.999), *args[at + 1:])
        _eager_launch(kernel, grid, args, kwargs)

    found = replay_launches(launches, _eager_launch, other_tau)
    assert found and all(line.startswith("launch 1 (qada_fused_split_kernel): ") for line in found), found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("criterion", [{"name": "qada", "tau": 0.3}, {"name": "qada_tail", "tau": 0.3}],
                         ids=["qada", "qada_tail"])
def test_gpu_each_fused_launch_compiled_equals_eager(model, reference, criterion):
    """On a GPU every kernel launch of an eager fused decode (6 steps), made once by ``torch.compile`` (Inductor
    compiles the kernel as inside the compiled step: its own specialisation, Python floats as fp64) and once by
    Triton's launcher, on identical copies of its arguments: the same tensors after each. Where the compiled step
    differs from the eager one on the same inputs (the test above), this names the kernel and the launch."""
    import functools

    from qada.attention import _triton_kernel
    from tests.step_replay import recording_launches, replay_launches

    run = make_run("stored", {"name": "triton_fused", "block_size": 16}, reference, criterion, compile=False)
    with recording_launches() as launches, torch.no_grad():
        greedy(model, run, "static")
    torch._dynamo.reset()
    compiled = {}

    def inductor(kernel, grid, args, kwargs):
        key = (kernel, grid, repr(sorted(kwargs.items())))
        if key not in compiled:
            # dynamic=False: at a second shape, a recompile with symbolic sizes failed in AOT's merge of the
            # aliased arguments (``set_`` on a storage of symbolic size, H200, torch 2.11)
            compiled[key] = torch.compile(functools.partial(_triton_kernel._launch, kernel, grid, **kwargs),
                                          fullgraph=True, backend="inductor", dynamic=False)
        compiled[key](*args)

    with torch._dynamo.config.patch(cache_size_limit=64):
        found = replay_launches(launches, _eager_launch, inductor)
    assert found == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("criterion", [{"name": "qada", "tau": 0.3}, {"name": "qada_tail", "tau": 0.3}],
                         ids=["qada", "qada_tail"])
def test_gpu_fused_layer_step_compiles_and_decides_as_eager(model, reference, criterion):
    """On a GPU the ``triton_fused`` layer step with ``compile_step=True`` compiles with its launches (no eager
    fallback, which warns: the executor's runtime check is not traced) and gives the eager step's tokens and
    statistics. (Not the default: see :attr:`~qada.attention.FusedTritonExecutor.compile_step`.)"""
    executor = {"name": "triton_fused", "block_size": 16, "compile_step": True}
    with torch.no_grad():  # as decoding runs (generate, the evaluations, the benchmarks)
        eager_tokens, eager = greedy(model, make_run("stored", executor, reference, criterion, compile=False),
                                     "static")
        run = make_run("stored", executor, reference, criterion, compile=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            tokens, compiled = greedy(model, run, "static")
    assert run.layer_step.compiled, run.layer_step.eager_reason
    assert torch.equal(tokens, eager_tokens)
    for key in ("sparsity", "kv_sparsity", "decode_steps"):
        assert compiled[key] == pytest.approx(eager[key]), (compiled, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("criterion", "source", "options"), [
    ({"name": "qada", "tau": 0.3}, "stored", {}), ({"name": "qada_tail", "tau": 0.3}, "stored", {}),
    ({"name": "qada_tail_budget", "sparsity": 0.5}, "stored", {}),
    ({"name": "qada", "tau": 0.3}, "stored", {"estimate_in_splits": True}),
    ({"name": "qada", "tau": 0.3}, "current", {"estimate_in_splits": True})],
    ids=["qada", "qada_tail", "qada_tail_budget", "qada estimating", "qada estimating current"])
def test_gpu_fused_cuda_graphs_replay_equals_eager(model, reference, criterion, source, options):
    """``triton_fused`` (its layer step eager, the default ``compile_step=False``) inside a model compiled with
    ``mode="reduce-overhead"`` (CUDA graphs), over two sequences: the replayed steps give an eager run's tokens and
    statistics. (With the layer step compiled, a step that fell back to eager while the graph was recorded left its
    tensors in the graph's pool: "Detected 10 tensor(s) in the cudagraph pool not tracked as outputs", H200.)
    ``estimating``: the estimate in the splits and the moment step, one decode step ahead, inside the combine launch
    (two launches a layer; the moments a replayed step reads are the ones the step before wrote)."""
    from tests.test_buffer_decode import greedy_compiled

    executor = {"name": "triton_fused", "block_size": 16, **options}
    torch._dynamo.reset()
    run = make_run(source, executor, reference, criterion)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for seed in (3, 5):
        graphs = greedy_compiled(model, run, 8, {}, device=DEVICE, seed=seed, forward=forward)
        eager = greedy_compiled(model, make_run(source, executor, reference, criterion, compile=False), 8,
                                {"disable": True}, device=DEVICE, seed=seed)
        assert torch.equal(graphs[0], eager[0])
        for key in ("sparsity", "kv_sparsity", "decode_steps"):
            assert graphs[1][key] == pytest.approx(eager[1][key])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("criterion", "decide_once", "options"), [
    ({"name": "qada", "tau": 0.3}, False, {}), ({"name": "qada", "tau": 0.3}, True, {}),
    ({"name": "qada", "tau": 0.3}, False, {"estimate_in_splits": True}),
    ({"name": "qada_tail", "tau": 0.3}, False, {}), ({"name": "qada_tail", "tau": 0.3}, True, {}),
    ({"name": "qada_tail_budget", "sparsity": 0.5}, None, {})],
    ids=["qada", "qada once", "qada estimating", "qada_tail", "qada_tail once", "qada_tail_budget"])
def test_gpu_programmatic_launches_equal_ordinary_ones(model, reference, criterion, decide_once, options):
    """``pdl=True`` (programmatic dependent launches on sm_90+: a split starts while the moment step runs and waits
    for it before reading its estimate; the combine waits for the splits), eagerly and replayed in a model's CUDA
    graphs over two sequences: an ordinary eager run's tokens and statistics. ``estimating``: the combine launch's
    moment programs wait for the splits, which read the moments they overwrite for the next step."""
    from tests.test_buffer_decode import greedy_compiled

    executor = {"name": "triton_fused", "block_size": 16, "decide_once": decide_once, "pdl": True, **options}
    ordinary = dict(executor, pdl=False)
    run = make_run("stored", executor, reference, criterion)
    assert run.executor.programmatic(torch.device(DEVICE)) == (torch.cuda.get_device_capability(DEVICE)[0] >= 9)
    torch._dynamo.reset()
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for seed in (3, 5):
        expected = greedy_compiled(model, make_run("stored", ordinary, reference, criterion, compile=False), 8,
                                   {"disable": True}, device=DEVICE, seed=seed)
        eager = greedy_compiled(model, make_run("stored", executor, reference, criterion, compile=False), 8,
                                {"disable": True}, device=DEVICE, seed=seed)
        graphs = greedy_compiled(model, run, 8, {}, device=DEVICE, seed=seed, forward=forward)
        for got in (eager, graphs):
            assert torch.equal(got[0], expected[0])
            for key in ("sparsity", "kv_sparsity", "decode_steps"):
                assert got[1][key] == pytest.approx(expected[1][key])


def test_programmatic_launches_only_where_the_device_has_them():
    """``pdl`` is a bool, off on the CPU (Triton's interpreter); where it applies (an sm_90 GPU), the same output and
    decision as without."""
    with pytest.raises(ValueError, match="pdl"):
        FusedTritonExecutor(pdl="yes")
    executor = FusedTritonExecutor(block_size=16, pdl=True)
    assert not executor.programmatic(torch.device("cpu"))
    step = make_step(1, 4, 2, 64, 16, None, None, torch.float32, seed=3)
    with_pdl = executor.decide_and_attend(fresh(step), 0.5)
    without = FusedTritonExecutor(block_size=16).decide_and_attend(fresh(step), 0.5)
    assert torch.equal(with_pdl.output, without.output) and torch.equal(with_pdl.local, without.local)


def test_programmatic_launches_need_intrinsics_that_compile(monkeypatch):
    """Triton 3.4's PDL intrinsics took ``_builder`` where its code generator passed ``_semantic`` (no kernel calling
    them compiled): such intrinsics, or none, count as no PDL; this Triton's (3.5 on) count."""
    from qada.attention import _triton_kernel, triton_decode

    if triton_decode.triton_version() >= (3, 5):
        assert _triton_kernel.pdl_intrinsics_compile()

    def old_style(_builder=None):
        return None

    monkeypatch.setattr(_triton_kernel, "gdc_wait", old_style)
    assert not _triton_kernel.pdl_intrinsics_compile()
    monkeypatch.setattr(_triton_kernel, "gdc_wait", None)
    assert not _triton_kernel.pdl_intrinsics_compile()


def test_add_to_must_be_float64_sums_and_one_index():
    """The combine's ``add_to`` refuses sums of another dtype, width or device and an index of several elements."""
    step = make_step(1, 4, 2, 64, 16, None, None, torch.float32, seed=3)
    executor = FusedTritonExecutor(block_size=16)
    for sums, layer in ((torch.zeros(2, 5), torch.tensor(0)), (torch.zeros(2, 4, dtype=torch.float64), torch.tensor(0)),
                        (torch.zeros(2, 5, dtype=torch.float64), torch.tensor([0, 1])),
                        (torch.zeros(2, 5, dtype=torch.float64, device="meta"), torch.tensor(0))):  # another device
        with pytest.raises(ValueError, match="add_to"):
            executor.decide_and_attend(fresh(step), 0.5, add_to=(sums, layer))
