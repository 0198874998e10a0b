"""The ``dense`` criterion's layer step on the ``triton`` executor (:mod:`qada.models.dense_step`): its two launches
against the general layer step's decision, group policy and statistics followed by the same executor. On CPU the
kernels run in Triton's interpreter (small shapes only)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from tiny_models import tiny_model  # noqa: E402

from qada.attention import EXECUTORS, TritonExecutor, decode_attention  # noqa: E402
from qada.attention.base import GroupDecision  # noqa: E402
from qada.criteria import CRITERIA  # noqa: E402
from qada.criteria.baselines import DenseCriterion  # noqa: E402
from qada.models import build_run  # noqa: E402
from qada.models import run as run_module  # noqa: E402
from qada.models.dense_step import dense_decision, dense_layer_step, takes_dense_step  # noqa: E402
from qada.models.layer_step import DENSE_STEP_EAGER, LayerStep, layer_step  # noqa: E402
from qada.models.observers import DecisionRecorder  # noqa: E402
from qada.moments import StoredMoments  # noqa: E402
from qada.step import DecodeStep  # noqa: E402
from qada.window import Window  # noqa: E402
from tests.test_attention_triton import DEVICE  # noqa: E402
from tests.test_dense_step_sdpa import assert_same_dense_decisions  # noqa: E402
from tests.test_fused_decision import greedy  # noqa: E402
from tests.triton_launches import ALLOCATIONS_AND_VIEWS, LaunchRecorder, refusing_host_reads  # noqa: E402

WINDOW = Window(16, 4)


def step_arguments(b=3, H=8, H_kv=2, C=96, d=32, starts=(0, 5, 60), ends=(96, 80, 70), dtype=torch.float32):
    """:func:`~qada.models.layer_step.layer_step`'s tensors for rows of unequal bounds (the last row holds no more
    tokens than the window: no bulk, all local)."""
    g = torch.Generator().manual_seed(11)
    query = torch.randn(b, H, 1, d, generator=g).to(DEVICE, dtype)
    keys = (torch.randn(b, H_kv, C, d, generator=g) * 1.5).to(DEVICE, dtype)
    values = torch.randn(b, H_kv, C, d, generator=g).to(DEVICE, dtype)
    start, end = (torch.tensor(x, device=DEVICE) for x in (starts, ends))
    return query, keys, values, start, end, d**-0.5


def general_then_triton(executor, query, keys, values, start, end, scale, sums, layer, policy="exact"):
    """The general layer step for the ``dense`` criterion, then the executor on its decision: ``(output,
    bulk_blocks, result)``."""
    result = layer_step(query, keys, values, start, end, scale, layer, None, {}, None, None, sums,
                        criterion=DenseCriterion(), moments=None, window=WINDOW, policy=policy)
    step = DecodeStep(query[:, :, 0], keys, scale, WINDOW, start=start, end=end, values=values)
    output, bulk_blocks = executor.attend(step, GroupDecision(result.local, result.read))
    return output, bulk_blocks, result


@pytest.mark.parametrize("policy", ["exact", "promote"])
@pytest.mark.parametrize("bounds", ["rows", "full"])
def test_dense_step_equals_the_general_step_then_the_executor(monkeypatch, policy, bounds):
    """Two launches, nothing else on the device, no host read; the same output (bit for bit: the same split
    kernel on the same blocks), bulk-block count and statistics row (exact) as the general step's decision,
    group policy and statistics followed by the executor; the row added to the layer's sums only."""
    query, keys, values, start, end, scale = step_arguments()
    if bounds == "full":
        start = end = None
    executor = EXECUTORS.build("triton", block_size=16, num_splits=3, group_policy=policy)
    layer = torch.tensor(1, device=DEVICE)
    sums = torch.rand(3, 5, dtype=torch.float64, device=DEVICE)
    general_sums = sums.clone()
    expected, expected_blocks, general = general_then_triton(executor, query, keys, values, start, end, scale,
                                                             general_sums, layer, policy)
    record = LaunchRecorder(monkeypatch)
    with refusing_host_reads(monkeypatch), record:
        got = dense_layer_step(query, keys, values, start, end, scale, layer, None, {}, None, None, sums,
                               criterion=DenseCriterion(), moments=None, window=WINDOW, policy=policy,
                               executor=executor)
    assert [name for name, _ in record.launches] == ["qada_decode_split_kernel", "qada_decode_combine_kernel"]
    assert set(record.ops) <= ALLOCATIONS_AND_VIEWS | {"aten.unsqueeze.default"}, sorted(set(record.ops))
    assert torch.equal(got.output, expected)
    assert int(got.bulk_blocks) == int(expected_blocks) > 0
    assert torch.equal(got.counts, general.counts), (got.counts, general.counts)
    assert torch.equal(sums, general_sums)
    if bounds == "rows":  # the last row has no bulk: its heads local, its bulks not read
        assert 0 < float(got.counts[0, 0]) < 1 and 0 < float(got.counts[0, 1]) < 1
    assert got.decided is None and got.local is None and got.read is None and got.window_keys is None
    assert int(got.fail_safe) == 0


def test_dense_step_in_bfloat16_with_sinks_and_a_soft_cap():
    """The model features the executor takes: the same output as the general step then the executor."""
    query, keys, values, start, end, scale = step_arguments(dtype=torch.bfloat16)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    executor = EXECUTORS.build("triton", block_size=16, num_splits=2)
    layer = torch.tensor(0, device=DEVICE)
    got = dense_layer_step(query, keys, values, start, end, scale, layer, None, {}, sinks, 30.0, None,
                           criterion=DenseCriterion(), moments=None, window=WINDOW, policy="exact", executor=executor)
    step = DecodeStep(query[:, :, 0], keys, scale, WINDOW, start=start, end=end, values=values, sink_logits=sinks,
                      softcap=30.0)
    decided, local, read = dense_decision(DenseCriterion(), step, "exact")
    expected, _ = executor.attend(step, GroupDecision(local, read))
    assert torch.equal(got.output, expected) and got.output.dtype == torch.bfloat16
    assert not decided.any() and torch.equal(read, torch.tensor([[True, True], [True, True], [False, False]]))


def test_which_runs_take_the_dense_step():
    """The plain ``dense`` criterion without moments on the ``triton`` executor, or ``triton_fused`` (nothing to
    fuse: its run builds, where another criterion it does not decide is refused), or ``sdpa``
    (``tests/test_dense_step_sdpa.py``); not a subclass, not with a moment source fed, not on a subclass of
    ``triton`` that overrides ``attend`` alone, not on ``flex`` (no ``attend_dense``), not another criterion."""

    class Denser(DenseCriterion):
        pass

    class OwnAttention(TritonExecutor):  # a user's executor that changes attend: its attend must run
        def attend(self, step, decision):
            return super().attend(step, decision)

    class OwnDense(OwnAttention):  # ... unless it defines attend_dense too
        def attend_dense(self, step, add_to=None):
            return super().attend_dense(step, add_to)

    triton = EXECUTORS.build("triton")
    assert takes_dense_step(DenseCriterion(), None, triton)
    assert not takes_dense_step(Denser(), None, triton)
    assert not takes_dense_step(DenseCriterion(), None, OwnAttention())
    assert takes_dense_step(DenseCriterion(), None, OwnDense())
    assert not takes_dense_step(DenseCriterion(), StoredMoments(), triton)
    assert takes_dense_step(DenseCriterion(), None, EXECUTORS.build("sdpa"))
    assert not takes_dense_step(DenseCriterion(), None, EXECUTORS.build("flex"))
    assert takes_dense_step(DenseCriterion(), None, EXECUTORS.build("triton_fused"))
    fused = build_run(criterion="dense", moments="none", executor="triton_fused")
    assert fused.layer_step.fused is fused.executor and fused.layer_step.eager.func is dense_layer_step
    with pytest.raises(ValueError, match="plain 'qada' criterion"):
        build_run(criterion="local", moments="none", executor="triton_fused")
    assert not takes_dense_step(CRITERIA.build("local"), None, triton)
    step = LayerStep(CRITERIA.build("oracle", tau=0.5), None, WINDOW, "exact", None)
    with pytest.raises(ValueError, match="plain 'dense' criterion"):
        step.take_dense_step(triton)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").to(DEVICE)


def dense_run(executor="triton", observers=(), compile=None):
    spec = {"name": executor, "block_size": 16} if executor == "triton" else executor
    return build_run(criterion="dense", moments="none", executor=spec,
                     window={"t_local": 8, "t_sink": 2}, observers=observers, compile=compile)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_model_decodes_the_same_through_the_dense_step(model, monkeypatch, cache):
    """On the tiny model (two rows, one left-padded): the run's layer step is the dense step (two launches per
    layer and step), with the same tokens and statistics as the general step on the same executor and as ``sdpa``;
    an observer sees the dense decision (every head dense) as the general step's observer does."""
    run = dense_run(observers=[DecisionRecorder()])
    tokens, summary = greedy(model, run, cache, steps=3)
    step = run.layer_step
    assert step.fused is run.executor and step.eager_reason == (None if step.backend is None else DENSE_STEP_EAGER)
    monkeypatch.setattr(run_module, "takes_dense_step", lambda *args: False)
    general = dense_run(observers=[DecisionRecorder()])
    general_tokens, general_summary = greedy(model, general, cache, steps=3)
    assert general.layer_step.fused is None
    sdpa_tokens, _ = greedy(model, dense_run("sdpa"), cache, steps=3)
    assert torch.equal(tokens, general_tokens) and torch.equal(tokens, sdpa_tokens)
    assert summary == general_summary and summary["sparsity"] == 0 and summary["kv_read"] == 1
    assert_same_dense_decisions(run, general, 3 * model.config.num_hidden_layers)


def test_model_dense_step_launches_two_kernels_per_layer(model, monkeypatch):
    """A decode step of the whole model: the split and the combine per layer, nothing else of qada's on the device
    (the general step compiled for a GPU ran eight kernels of its own before them)."""
    record = LaunchRecorder(monkeypatch)
    greedy(model, dense_run(compile=True), "static", steps=2)
    layers = model.config.num_hidden_layers
    names = [name for name, _ in record.launches]
    assert names == ["qada_decode_split_kernel", "qada_decode_combine_kernel"] * (2 * layers)


def test_the_bandwidth_benchmark_captures_the_dense_step():
    """``benchmarks/attention.py``'s graph-captured rows: with every group dense on an executor with a dense step
    (``triton``, ``sdpa``), that step alone (what qada's all-dense path runs; the harness's group policy and
    sparsities are no longer timed with it), the same output as the executor's whole call; with local groups, that
    whole call."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.attention import graph_call

    query, keys, values, _, _, scale = step_arguments(b=2, starts=(0, 0), ends=(96, 96))
    dense = torch.zeros(2, 8, dtype=torch.bool, device=DEVICE)
    half = dense.clone()
    half[:, :4] = True
    for executor in (EXECUTORS.build("triton", block_size=16), EXECUTORS.build("sdpa")):
        call, name = graph_call(executor, 0, query, keys, values, dense, WINDOW, scale)
        assert name == "attend_dense"
        whole = decode_attention(executor, query, keys, values, dense, WINDOW, scale)
        assert torch.equal(call(), whole.output)
        call, name = graph_call(executor, 1, query, keys, values, half, WINDOW, scale)
        assert name == "decode_attention"
        expected = decode_attention(executor, query, keys, values, half, WINDOW, scale).output
        assert torch.equal(call().output, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_dense_step_cuda_graphs_replay_equals_eager(model, monkeypatch):
    """The dense step inside a model compiled with ``mode="reduce-overhead"`` (CUDA graphs), over two sequences: the
    replayed steps give the tokens and statistics of the general step run eagerly on the same executor."""
    from tests.test_buffer_decode import greedy_compiled

    torch._dynamo.reset()
    run = dense_run(compile=True)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for seed in (3, 5):
        graphs = greedy_compiled(model, run, 8, {}, device=DEVICE, seed=seed, forward=forward)
        with monkeypatch.context() as patched:  # the general step, eagerly
            patched.setattr(run_module, "takes_dense_step", lambda *args: False)
            general = dense_run(compile=False)
            eager = greedy_compiled(model, general, 8, {"disable": True}, device=DEVICE, seed=seed)
        assert run.layer_step.fused is run.executor and general.layer_step.fused is None
        assert torch.equal(graphs[0], eager[0])
        for key in ("sparsity", "kv_sparsity", "kv_read", "decode_steps"):
            assert graphs[1][key] == pytest.approx(eager[1][key])
