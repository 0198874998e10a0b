# ruff: noqa: F811 - the fixtures model and reference are imported from test_buffer_decode, then requested by name
"""The one decode step of a global layer (issue 30): every criterion compiled, the same as eager.

* every criterion of the registry (and one registered here, the custom-criterion guide's top-k) decodes on a
  ``StaticCache`` eagerly (``compile=False``) and compiled (``torch.compile(fullgraph=True)``) with identical tokens
  and statistics, compiles once per run (no recompile across layers and steps), never falls back to eager, and
  reads the host nowhere in its eager step; on a ``DynamicCache`` (its steps always eager) it gives the same again;
* inductor (the default backend) gives the eager tokens and statistics for ``qada`` and ``qada_tail``;
* a criterion that reads the host still runs: eagerly, with one warning naming it;
* outside the compiled step a layer's decode step runs at most 5 eager operations besides the executor's attention
  (plus, once per forward, the rows' bounds shared by every layer);
* :func:`qada.testing.check_graph_safe` says yes to every built-in criterion and no to one that syncs.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import pytest
import torch
from test_buffer_decode import WINDOW, model, moments, reference  # noqa: F401 - the same model, reference, prompt
from test_buffer_decode import greedy as buffer_greedy
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from qada.criteria import CRITERIA, BudgetCriterion, HeadCriterion, register_criterion
from qada.models import build_run
from qada.models.layer_step import DENSE_STEP_EAGER, LayerStep
from qada.models.run import QAdARun
from qada.testing import GraphSafetyError, check_graph_safe, no_host_reads

STEPS = 8
MASK = [[True, False, True, False], [False, True, True, True]]
TAIL = {"heavy": 4, "observe": 4, "page_size": 2, "pages": 2}


@dataclass
class TopKPeaked(BudgetCriterion):
    """The custom-criterion guide's example: the heads with the most peaked window scores are local."""

    def score(self, step):
        scores = step.local_scores
        return scores.amax(-1) - scores.mean(-1)


CONFIGS = {  # one configuration per registered name (the composites wrap criteria that keep state)
    "dense": "dense",
    "local": "local",
    "oracle": {"name": "oracle", "tau": 0.3},
    "qada": {"name": "qada", "tau": 0.3},
    "qada_budget": {"name": "qada_budget", "sparsity": 0.6},
    "qada_calibrated": {"name": "qada_calibrated", "tau": 0.3, "slope": [[1.0, 0.9, 1.1, 1.0]] * 2,
                        "offset": [[0.0, 0.3, -0.2, 0.1]] * 2},
    "qada_tail": {"name": "qada_tail", "tau": 0.3, **TAIL},
    "qada_tail_budget": {"name": "qada_tail_budget", "sparsity": 0.6, **TAIL},
    "quest": {"name": "quest", "pages": 2, "page_size": 4},
    "static": {"name": "static", "mask": MASK},
    "hybrid": {"name": "hybrid", "base": {"name": "qada_tail", "tau": 0.3, **TAIL},
               "dense_mask": [[True, False, False, False], [False, False, True, False]]},
    "any_of": {"name": "any_of", "criteria": [{"name": "qada", "tau": 0.2}, {"name": "static", "mask": MASK}]},
    "all_of": {"name": "all_of", "criteria": [{"name": "qada_budget", "sparsity": 0.6, "per_group": True},
                                              {"name": "oracle", "tau": 0.2}]},
    "not": {"name": "not", "criterion": {"name": "oracle", "tau": 0.6}},
    "layer_override": {"name": "layer_override", "base": {"name": "qada_tail", "tau": 0.3, "attend_exact": True,
                                                          **TAIL},
                       "overrides": {0: "dense", 1: {"name": "qada_tail_budget", "sparsity": 0.5, **TAIL}}},
    "test_topk_peaked": {"name": "test_topk_peaked", "sparsity": 0.5},
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The test's own criteria, registered while this module runs (other modules list the registry)."""
    for name, cls in (("test_topk_peaked", TopKPeaked), ("test_host_reader", HostReader)):
        register_criterion(name, override=True)(cls)
    yield
    for name in ("test_topk_peaked", "test_host_reader", "test_bad_shape"):
        CRITERIA._classes.pop(name, None)


def make_run(criterion, reference, compile, source="stored") -> QAdARun:
    return build_run(criterion=criterion, moments=moments(source, reference), executor="sdpa", window=WINDOW,
                     compile=compile)


def greedy(model, run: QAdARun, cache_kind: str, steps: int = STEPS):
    """``(tokens [2, steps], summary)`` of :func:`test_buffer_decode.greedy` (the same prompt and decoding)."""
    tokens, _, summary = buffer_greedy(model, run, cache_kind, steps)
    return tokens, summary


class CountingBackend:
    """A ``torch.compile`` backend (``aot_eager``: traced and functionalised, not code-generated) that counts how
    often it compiles."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, graph, inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.compiles += 1
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(graph, inputs)


@contextlib.contextmanager
def layer_steps_never_read_the_host():
    """:func:`qada.testing.no_host_reads` around every eager layer step (the run's decision, not the executor)."""
    original = LayerStep.__call__

    def guarded(self, buffered, *args):
        if self.fused is not None:  # the step is the executor's (the dense criterion's on sdpa: its own host read)
            return original(self, buffered, *args)
        with no_host_reads():
            return original(self, buffered, *args)

    LayerStep.__call__ = guarded
    try:
        yield
    finally:
        LayerStep.__call__ = original


STATISTICS = ("sparsity", "kv_sparsity", "kv_read", "fail_safe", "decode_steps")


def test_the_matrix_covers_the_registry():
    built_in = {name for name in CRITERIA.names() if CRITERIA.get(name).__module__.startswith("qada.")}
    assert len(built_in) >= 14 and built_in <= set(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_criterion_compiles_once_and_equals_eager(model, reference, name):
    criterion = CONFIGS[name]
    with layer_steps_never_read_the_host():
        eager_tokens, eager = greedy(model, make_run(criterion, reference, False), "static")
    backend = CountingBackend()
    run = make_run(criterion, reference, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an eager fallback would warn
        tokens, compiled = greedy(model, run, "static")
    graphs = 1  # one graph for every layer and step, no recompile
    if name == "dense":  # its step is the executor's attention alone (qada.models.dense_step): nothing to compile
        assert run.layer_step.fused is run.executor and run.layer_step.eager_reason == DENSE_STEP_EAGER
        graphs = 0
    else:
        assert run.layer_step.compiled, run.layer_step.eager_reason
    # an extra set (quest, layer_override) is merged inside the graph (sdpa takes the window's attention from the
    # step), so there is no compiled merge after the executor
    assert backend.compiles == graphs
    assert torch.equal(tokens, eager_tokens)
    for key in STATISTICS:
        assert compiled[key] == pytest.approx(eager[key], rel=1e-12, abs=1e-12), key
    dynamic_tokens, dynamic = greedy(model, make_run(criterion, reference, backend), "dynamic")
    assert backend.compiles == graphs  # a growing cache's steps run eagerly
    assert torch.equal(dynamic_tokens, eager_tokens)
    for key in STATISTICS:
        assert dynamic[key] == pytest.approx(eager[key], rel=1e-9, abs=1e-12), key


def test_the_matrix_decides_both_ways(model, reference):
    """The equalities above are not vacuous: the adaptive criteria make some heads local and some dense."""
    for name in ("qada", "qada_tail", "qada_tail_budget", "layer_override", "test_topk_peaked"):
        summary = greedy(model, make_run(CONFIGS[name], reference, False), "static", steps=3)[1]
        assert 0.0 < summary["sparsity"] < 1.0, name


@pytest.mark.parametrize("name", ["qada", "qada_tail"])
def test_inductor_steps_equal_eager(model, reference, name):
    """The default backend (inductor, code-generated kernels): the eager tokens; statistics equal up to float
    rounding of the fused kernels (a ratio within rounding of tau could flip; none does here)."""
    eager_tokens, eager = greedy(model, make_run(CONFIGS[name], reference, False), "static")
    run = make_run(CONFIGS[name], reference, True)
    tokens, compiled = greedy(model, run, "static")
    assert run.layer_step.compiled and run.backend == "inductor"
    assert torch.equal(tokens, eager_tokens)
    for key in STATISTICS:
        assert compiled[key] == pytest.approx(eager[key], rel=1e-6, abs=1e-9), key


@dataclass
class HostReader(HeadCriterion):
    """Local where the window's peak exceeds the (host-read) mean peak: not graph-safe."""

    def decide(self, step):
        peak = step.local_scores.amax(-1)
        threshold = float(peak.mean().item())
        return peak > threshold


def test_a_criterion_that_reads_the_host_runs_eagerly_with_one_warning(model, reference):
    eager_tokens, eager = greedy(model, make_run("test_host_reader", reference, False), "static")
    run = make_run("test_host_reader", reference, "eager")
    with pytest.warns(RuntimeWarning, match="criterion 'test_host_reader' cannot be compiled") as caught:
        tokens, summary = greedy(model, run, "static")
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert not run.layer_step.compiled and run.layer_step.eager_reason
    assert torch.equal(tokens, eager_tokens) and summary["sparsity"] == pytest.approx(eager["sparsity"])


def test_an_error_of_the_criterion_itself_is_raised_not_hidden(model, reference):
    @register_criterion("test_bad_shape", override=True)
    @dataclass
    class BadShape(HeadCriterion):
        def decide(self, step):
            return torch.zeros(step.batch_size, dtype=torch.bool)

    with pytest.raises(ValueError, match="must return a bool tensor of shape"):
        greedy(model, make_run("test_bad_shape", reference, "eager"), "static", steps=1)


class EagerOps(TorchDispatchMode):
    """Records the operations dispatched eagerly, except inside the compiled layer step (and its merge of an extra set)
    and the executor's attention."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_few_eager_operations_outside_the_compiled_step(model, reference, name, monkeypatch):
    run = make_run(CONFIGS[name], reference, "eager")
    decode, layer_step, attend = QAdARun.decode, LayerStep.__call__, type(run.executor).attend
    merge = LayerStep.merge
    per_step: list[int] = []
    mode = EagerOps()

    def outside(function):
        def call(*args, **kwargs):
            with _disable_current_modes():
                return function(*args, **kwargs)
        return call

    def counted(self, *args, **kwargs):
        mode.ops.clear()
        with mode:
            output = decode(self, *args, **kwargs)
        per_step.append(len(mode.ops))
        return output

    monkeypatch.setattr(QAdARun, "decode", counted)
    monkeypatch.setattr(LayerStep, "__call__", outside(layer_step))
    monkeypatch.setattr(LayerStep, "merge", outside(merge))  # compiled too (window ∪ an extra set)
    monkeypatch.setattr(type(run.executor), "attend", outside(attend))
    greedy(model, run, "static", steps=3)
    # compiled, or (the dense criterion) the executor's attention alone, the step counted outside as the executor
    assert run.layer_step.compiled or (name == "dense" and run.layer_step.fused is run.executor)
    layers = model.config.num_hidden_layers
    first, others = per_step[::layers], [n for i, n in enumerate(per_step) if i % layers]
    assert max(others) == 0, per_step  # per layer: none (the statistics' addition is in the compiled step)
    # the first layer of a forward also derives the rows' bounds from the mask and checks their growth, once for
    # every layer (13 operations today: 0.4 per layer on a 30-layer model)
    assert max(first) - max(others) <= 14, per_step


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_check_graph_safe_accepts_every_built_in_criterion(name):
    check_graph_safe(CONFIGS[name], heads=4, kv_heads=2)  # the [2, 4] per-layer grids of the tiny model


def test_check_graph_safe_refuses_a_criterion_that_reads_the_host():
    with pytest.raises(GraphSafetyError, match="does not compile as one graph"):
        check_graph_safe("test_host_reader")


@pytest.mark.parametrize("source", ["stored", "current"])
def test_the_compiled_step_leaves_the_moment_state_of_the_eager_one(model, reference, source):
    """The state the compiled step updates in place (its arguments) ends where the eager step's ends."""

    def decoded(compile):
        run = make_run(CONFIGS["qada_tail"], reference, compile, source)
        greedy(model, run, "static")
        return [run.moments.step_state(layer) for layer in range(model.config.num_hidden_layers)]

    eager, compiled = decoded(False), decoded(CountingBackend())
    for a, b in zip(eager, compiled, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", ["qada_tail", "layer_override"])
def test_a_run_over_prompts_of_several_lengths_compiles_at_most_twice(model, reference, name):
    """An evaluation reuses one run for prompts of many lengths (static caches of many sizes): the first size
    compiles with static shapes, the second once more with symbolic sizes, then never again."""
    backend = CountingBackend()
    run = make_run(CONFIGS[name], reference, backend)
    eager = make_run(CONFIGS[name], reference, False)
    for extra in (0, 5, 9, 14):
        expected = greedy(model, eager, "static", steps=4 + extra)
        got = greedy(model, run, "static", steps=4 + extra)
        assert torch.equal(got[0], expected[0])
        assert got[1]["kv_read"] == pytest.approx(expected[1]["kv_read"])
    assert run.layer_step.compiled and backend.compiles <= 2


def test_compile_takes_a_bool_or_a_known_backend(monkeypatch):
    from qada.models.step_compile import resolve_compile

    assert resolve_compile(True) == "inductor" and resolve_compile(False) is None
    assert resolve_compile("aot_eager") == "aot_eager"
    monkeypatch.setenv("QADA_COMPILE", "0")
    assert resolve_compile(None) is None
    for bad in ("bogus", 3, ""):
        with pytest.raises(ValueError, match="expected compile to be a bool"):
            build_run("dense", "none", "sdpa", compile=bad)


def test_the_layer_step_adds_its_row_to_the_sums_it_is_given(model, reference):
    """Given the run's sums, a layer step adds its statistics row at its layer, in place (compiled or eager); the
    run's summary counts every decoded (layer, step) pair."""
    run = build_run(criterion={"name": "qada", "tau": 0.5}, moments=moments("stored", reference), window=WINDOW)
    calls = []
    original = LayerStep.__call__

    def recorded(self, buffered, *args):
        sums = args[-1]
        before = sums.clone()
        result = original(self, buffered, *args)
        calls.append((before, sums.clone(), int(args[6]), result.counts[0]))
        return result

    LayerStep.__call__ = recorded
    try:
        _, _, summary = buffer_greedy(model, run, "static")
    finally:
        LayerStep.__call__ = original
    assert calls
    for before, after, layer, row in calls:
        others = [i for i in range(after.shape[0]) if i != layer]
        assert torch.equal(after[others], before[others]) and torch.equal(after[layer], before[layer] + row)
    assert summary["decode_steps"] * model.config.num_hidden_layers == len(calls)
