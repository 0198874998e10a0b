"""The ``dense`` criterion's layer step on the ``sdpa`` executor (:meth:`~qada.attention.SDPAExecutor.attend_dense`):
no decision, no window attention, no host plan; the rows' bounds are its one host read on the CPU. Against the
general layer step's decision, group policy and statistics followed by the same executor."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from qada.attention import EXECUTORS
from qada.attention.base import GroupDecision
from qada.attention.sdpa import HostPlan, dense_row
from qada.criteria.baselines import DenseCriterion
from qada.models import build_run
from qada.models import run as run_module
from qada.models.dense_step import dense_decision, dense_layer_step, takes_dense_step
from qada.models.layer_step import DENSE_STEP_EAGER, layer_step
from qada.models.observers import DecisionRecorder
from qada.step import DecodeStep
from qada.window import Window
from tests.test_fused_decision import greedy

WINDOW = Window(16, 4)
BOUNDS = {  # (start, end) of three rows over 96 slots; the last row of "rows" and "growing, padded" has no bulk
    "rows": ((0, 5, 60), (96, 80, 76)),
    "ends": (None, (96, 90, 96)),
    "full": (None, None),
    "growing, padded": ((0, 7, 85), None),
}


def step_arguments(bounds, dtype=torch.float32, b=3, H=8, H_kv=2, C=96, d=32):
    g = torch.Generator().manual_seed(5)
    query = torch.randn(b, H, 1, d, generator=g).to(dtype)
    keys = (torch.randn(b, H_kv, C, d, generator=g) * 1.5).to(dtype)
    values = torch.randn(b, H_kv, C, d, generator=g).to(dtype)
    start, end = (None if x is None else torch.tensor(x) for x in BOUNDS[bounds])
    return query, keys, values, start, end, d**-0.5


def general_then_executor(executor, query, keys, values, start, end, scale, sums, layer):
    """The general layer step for the ``dense`` criterion, then ``executor`` on its decision (the step built as the
    run builds it: the window gathered, no window attention of the layer step's): ``(output, result)``."""
    result = layer_step(query, keys, values, start, end, scale, layer, None, {}, None, None, sums,
                        criterion=DenseCriterion(), moments=None, window=WINDOW, policy="exact")
    step = DecodeStep(query[:, :, 0], keys, scale, WINDOW, start=start, end=end, values=values)
    output, _ = executor.attend(step, GroupDecision(result.local, result.read))
    return output, result


@pytest.mark.parametrize("bounds", list(BOUNDS))
def test_the_dense_plan_is_the_plan_of_the_dense_decision(bounds):
    """:meth:`HostPlan.dense`, from the bounds alone, equals the plan the executor reads for the ``dense`` criterion's
    decision after the group policy, and names the rows without a bulk."""
    query, keys, values, start, end, scale = step_arguments(bounds)
    step = DecodeStep(query[:, :, 0], keys, scale, WINDOW, start=start, end=end, values=values)
    _, local, read = dense_decision(DenseCriterion(), step, "exact")
    plan, bulkless = HostPlan.dense(step)
    assert plan == HostPlan.read(step, local, read)
    assert bulkless == (~step.has_bulk).tolist()
    assert plan.any_local is (bounds in ("rows", "growing, padded"))


@pytest.mark.parametrize("host_skip", [None, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bounds", list(BOUNDS))
def test_dense_step_equals_the_general_step_then_the_executor(host_skip, dtype, bounds):
    """The same output (bit for bit where the executor skips on the host: the same plan, the same calls; within
    rounding elsewhere, where a row without a bulk attends over its row under its mask instead of over its window)
    and the same statistics row (exact), added to the layer's sums only."""
    query, keys, values, start, end, scale = step_arguments(bounds, dtype)
    executor = EXECUTORS.build("sdpa", host_skip=host_skip, min_split=16)
    layer = torch.tensor(1)
    sums = torch.rand(3, 5, dtype=torch.float64)
    general_sums = sums.clone()
    expected, general = general_then_executor(executor, query, keys, values, start, end, scale, general_sums, layer)
    got = dense_layer_step(query, keys, values, start, end, scale, layer, None, {}, None, None, sums,
                           criterion=DenseCriterion(), moments=None, window=WINDOW, policy="exact", executor=executor)
    assert got.output.dtype == dtype and got.output.shape == expected.shape
    if host_skip is None:
        assert torch.equal(got.output, expected)
    else:
        torch.testing.assert_close(got.output, expected)
    assert torch.equal(got.counts, general.counts), (got.counts, general.counts)
    assert torch.equal(sums, general_sums)
    assert got.decided is None and got.local is None and got.read is None and got.bulk_blocks is None


def test_dense_step_with_sinks_and_a_soft_cap():
    """The model features the executor takes (explicit scores): the output of the general step then the
    executor."""
    query, keys, values, start, end, scale = step_arguments("rows")
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2))
    executor = EXECUTORS.build("sdpa")
    got = dense_layer_step(query, keys, values, start, end, scale, torch.tensor(0), None, {}, sinks, 30.0, None,
                           criterion=DenseCriterion(), moments=None, window=WINDOW, policy="exact", executor=executor)
    step = DecodeStep(query[:, :, 0], keys, scale, WINDOW, start=start, end=end, values=values, sink_logits=sinks,
                      softcap=30.0)
    _, local, read = dense_decision(DenseCriterion(), step, "exact")
    expected, _ = executor.attend(step, GroupDecision(local, read))
    assert torch.equal(got.output, expected)


def test_dense_row_is_the_statistics_of_the_dense_decision():
    """:func:`dense_row` (the device path's statistics) against the general step's row on the same bounds."""
    for bounds in BOUNDS:
        query, keys, values, start, end, scale = step_arguments(bounds)
        general = layer_step(query, keys, values, start, end, scale, torch.tensor(0), None, {}, None, None, None,
                             criterion=DenseCriterion(), moments=None, window=WINDOW, policy="exact")
        step = DecodeStep(query[:, :, 0], keys, scale, WINDOW, start=start, end=end, values=values)
        assert torch.equal(dense_row(step.has_bulk), general.counts[0]), bounds


def test_the_dense_step_on_the_cpu_reads_the_bounds_once_and_decides_nothing(monkeypatch):
    """Rows of a preallocated buffer that all have a bulk: one host read (the bounds), and no operation besides the
    bounds' concatenation, the attention, the statistics row and its addition (and allocations and views): no
    decision, no window, no mask, no host plan."""
    from torch.utils._python_dispatch import TorchDispatchMode

    query, keys, values, _, _, scale = step_arguments("full")
    start, end, layer = torch.tensor([0, 0, 0]), torch.tensor([96, 96, 96]), torch.tensor(0)
    sums = torch.zeros(2, 5, dtype=torch.float64)
    executor = EXECUTORS.build("sdpa", streamed=False, products=False)  # (the streamed kernel is not a torch op)
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or original(self))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        got = dense_layer_step(query, keys, values, start, end, scale, layer, None, {}, None, None, sums,
                               criterion=DenseCriterion(), moments=None, window=WINDOW, policy="exact",
                               executor=executor)
    assert reads == [torch.Size([6])]
    views = {"view", "alias", "select", "unsqueeze", "slice", "expand"}
    assert set(ops.names) - views == {"cat", "_scaled_dot_product_flash_attention_for_cpu", "lift_fresh",
                                      "index_add_"}, ops.names
    assert ops.names.count("_scaled_dot_product_flash_attention_for_cpu") == 1  # every row and group in one call
    assert torch.equal(sums[0], got.counts[0]) and got.counts.tolist() == [[0.0, 0.0, 1.0, 0.0, 1.0]]


def test_the_sdpa_executor_takes_the_dense_step():
    """The plain ``dense`` criterion without moments on ``sdpa`` (and on ``auto``, which picks it on the CPU)."""
    assert takes_dense_step(DenseCriterion(), None, EXECUTORS.build("sdpa"))
    run = build_run(criterion="dense", moments="none", executor="sdpa")
    assert run.layer_step.fused is run.executor and run.layer_step.eager.func is dense_layer_step


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def dense_run(observers=(), compile=None):
    return build_run(criterion="dense", moments="none", executor="sdpa", window={"t_local": 8, "t_sink": 2},
                     observers=observers, compile=compile)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_model_decodes_the_same_through_the_dense_step(model, monkeypatch, cache):
    """On the tiny model (two rows, one left-padded): the run's layer step is the dense step, with the same tokens,
    statistics and observed decisions as the general step on the same executor."""
    run = dense_run(observers=[DecisionRecorder()], compile=True)
    tokens, summary = greedy(model, run, cache, steps=3)
    assert run.layer_step.fused is run.executor and run.layer_step.eager_reason == DENSE_STEP_EAGER
    monkeypatch.setattr(run_module, "takes_dense_step", lambda *args: False)
    general = dense_run(observers=[DecisionRecorder()], compile=True)
    general_tokens, general_summary = greedy(model, general, cache, steps=3)
    assert general.layer_step.fused is None
    assert torch.equal(tokens, general_tokens)
    assert summary == general_summary and summary["sparsity"] == 0 and summary["kv_read"] == 1
    assert_same_dense_decisions(run, general, 3 * model.config.num_hidden_layers)


def assert_same_dense_decisions(run, general, steps):
    """The dense step's ``run`` and the general step's ``general`` recorded (``DecisionRecorder``, their first
    observer) the same ``steps`` layer steps' decisions, every head dense."""
    events, general_events = run.observers[0].events, general.observers[0].events
    assert len(events) == len(general_events) == steps
    for event, expected in zip(events, general_events, strict=True):
        assert torch.equal(event.local, expected.local) and not event.local.any()
        assert torch.equal(event.effective_local, expected.effective_local)
