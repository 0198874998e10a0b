"""Decoding on a preallocated cache (issue 22): the whole buffer, the rows' ends as device tensors.

* the buffer (``StaticCache``) equals the growing cache (``DynamicCache``) in tokens, logits and statistics,
  for every built-in criterion, moment source and sync-free executor, with left padding and a stored range that
  jumps (the short-prompt rule switching) during decoding;
* no host read inside a decode step of qada's parts (``item``, ``tolist``, ``nonzero``, ``bool``, ``int``,
  ``float`` fail there);
* ``torch.inference_mode()`` works with every configuration, on both caches;
* a row that does not grow by one key is reported at the next summary, not silently decided on.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch
from tiny_models import tiny_model
from transformers import DynamicCache, StaticCache

from qada.models import attach, build_run
from qada.models.guards import StaleStateError
from qada.models.layer_step import LayerStep
from qada.models.run import QAdARun
from qada.moments import BucketedMoments, StoredMoments
from qada.moments.reference import collect_reference_keys, compute_bucketed_moments

WINDOW = {"t_local": 8, "t_sink": 2}
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
STEPS = 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(7))
    return collect_reference_keys(model, ids, chunk_size=16)


def moments(kind: str, reference):
    """Sources whose short-prompt rule switches while row 1 (15 real tokens) decodes: at 18 tokens."""
    if kind == "stored":
        source = StoredMoments(offset=12, min_bulk_keys=4)
        source.set_reference(reference)
        return source
    if kind == "bucketed":
        source = BucketedMoments(offset=12, min_bulk_keys=4, bucket_size=4)
        source.set_data(compute_bucketed_moments(reference, bucket_size=4, first=WINDOW["t_sink"], min_keys=4))
        return source
    return kind


CONFIGS = [
    ("dense", "none"),
    ("local", "none"),
    ({"name": "oracle", "tau": 0.3}, "none"),
    ({"name": "qada", "tau": 0.3}, "current"),
    ({"name": "qada", "tau": 0.3}, {"name": "current", "freeze": True}),
    ({"name": "qada", "tau": 0.3}, "stored"),
    ({"name": "qada", "tau": 0.3}, "bucketed"),
    ({"name": "qada_calibrated", "tau": 0.3, "slope": [[1.0, 0.9, 1.1, 1.0]] * 2,
      "offset": [[0.0, 0.2, -0.1, 0.0]] * 2}, "stored"),
    ({"name": "hybrid", "base": {"name": "qada", "tau": 0.3}, "dense_mask": [[True, False, False, False],
                                                                            [True, True, True, True]]}, "stored"),
    ({"name": "not", "criterion": {"name": "oracle", "tau": 0.3}}, "none"),
    ({"name": "qada_budget", "sparsity": 0.6}, "stored"),
    ({"name": "static", "mask": [[True, False, True, False], [False, False, True, True]]}, "none"),
    ({"name": "any_of", "criteria": [{"name": "qada", "tau": 0.3}, "local"]}, "stored"),
    ({"name": "layer_override", "base": {"name": "qada", "tau": 0.3}, "overrides": {0: "dense"}}, "stored"),
    ({"name": "qada_tail", "tau": 0.3, "heavy": 4, "observe": 4, "page_size": 2, "pages": 2}, "stored"),
    ({"name": "any_of", "criteria": [{"name": "qada_tail_budget", "sparsity": 0.6, "heavy": 2, "observe": 3,
                                      "page_size": 4, "pages": 1}, "local"]}, "current"),
]
EXECUTORS = [{"name": "sdpa", "host_skip": False}, "sdpa", "reference"]


def prompt(seed: int = 3):
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: row 1 holds 15 real tokens
    return ids, mask


def make_run(criterion, source, executor, reference) -> QAdARun:
    return build_run(criterion=criterion, moments=moments(source, reference) if isinstance(source, str) else source,
                     executor=executor, window=WINDOW)


def greedy(model, run: QAdARun, cache_kind: str, steps: int = STEPS, step_context=contextlib.nullcontext,
           seed: int = 3):
    """Greedy decoding of :func:`prompt` (``seed``): ``(tokens [2, steps], last logits, summary)``."""
    ids, mask = prompt(seed)
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 3)
    else:
        cache = DynamicCache(config=model.config)
    attach(model, run)
    run.reset_stats()
    try:
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        tokens = []
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            tokens.append(token)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            with step_context():
                out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(tokens, 1), out.logits, run.summary()
    finally:
        run.remove()


@contextlib.contextmanager
def count_buffer_steps(counter: list):
    """Count the layer steps that ran on a preallocated buffer."""
    original = LayerStep.__call__

    def spy(self, buffered, *args, **kwargs):
        if buffered:
            counter.append(1)
        return original(self, buffered, *args, **kwargs)

    LayerStep.__call__ = spy
    try:
        yield
    finally:
        LayerStep.__call__ = original


@pytest.mark.parametrize("executor", EXECUTORS, ids=["sdpa-no-host-skip", "sdpa", "reference"])
@pytest.mark.parametrize("criterion, source", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
def test_static_cache_equals_dynamic_cache(model, reference, criterion, source, executor):
    sliced = greedy(model, make_run(criterion, source, executor, reference), "dynamic")
    calls: list = []
    with count_buffer_steps(calls):
        buffered = greedy(model, make_run(criterion, source, executor, reference), "static")
    assert len(calls) == STEPS * model.config.num_hidden_layers  # every decode step took the buffer path
    assert torch.equal(sliced[0], buffered[0])
    torch.testing.assert_close(buffered[1], sliced[1], atol=1e-5, rtol=1e-5)
    for key in ("sparsity", "kv_sparsity"):
        assert buffered[2][key] == pytest.approx(sliced[2][key], abs=1e-9)
    assert buffered[2]["decode_steps"] == sliced[2]["decode_steps"] == STEPS
    assert buffered[2]["fail_safe"] == sliced[2]["fail_safe"]


def test_the_configurations_decide_both_ways(model, reference):
    """The equality above is not vacuous: QAdA with stored moments makes some heads local and some dense."""
    summary = greedy(model, make_run({"name": "qada", "tau": 0.3}, "stored", "sdpa", reference), "static")[2]
    assert 0.2 < summary["sparsity"] < 0.9 and 0.0 < summary["kv_sparsity"] < 1.0


def test_stored_range_jumps_during_decoding(model, reference):
    """Row 1 starts with 15 tokens: its reference range switches rule at 18 (a jump prepared at the prefill)."""
    run = make_run({"name": "qada", "tau": 0.3}, "stored", "sdpa", reference)
    greedy(model, run, "static", steps=1)
    state = run.moments.step_state(0)
    assert state["jump_n"][1].tolist() == [18, -1] and state["jump_n"][0].tolist() == [-1, -1]


HOST_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")
HOST_WRITES = ("tensor", "as_tensor")  # Python data -> a device tensor: a host-to-device copy (a sync on CUDA)


@contextlib.contextmanager
def no_host_reads_in_decode_steps():
    """Fail every host read of a tensor, and every tensor made from Python data, while qada's decode step of a
    layer runs (transformers' own code around it may read the host: dense has its one sync too)."""
    original = QAdARun.decode
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    saved_writes = {name: getattr(torch, name) for name in HOST_WRITES}

    def guarded(self, *args, **kwargs):
        for name in HOST_READS:
            setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read in a decode step: {_n}"))
        for name in HOST_WRITES:
            setattr(torch, name, lambda *a, _n=name, **k: pytest.fail(f"host-to-device copy in a decode step: {_n}"))
        try:
            return original(self, *args, **kwargs)
        finally:
            for name, function in saved.items():
                setattr(torch.Tensor, name, function)
            for name, function in saved_writes.items():
                setattr(torch, name, function)

    QAdARun.decode = guarded
    try:
        yield
    finally:
        QAdARun.decode = original


def held_tensors(obj, path: str = "run", seen: set | None = None, found: dict | None = None) -> dict:
    """``path -> (id, data_ptr)`` of every tensor that qada's objects under ``obj`` hold (attributes, lists,
    dicts; not the model's own modules)."""
    seen = set() if seen is None else seen
    found = {} if found is None else found
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[path] = (id(obj), obj.data_ptr())
    elif isinstance(obj, dict):
        for key, item in obj.items():
            held_tensors(item, f"{path}[{key!r}]", seen, found)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            held_tensors(item, f"{path}[{i}]", seen, found)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("qada"):
        for key, item in vars(obj).items():
            held_tensors(item, f"{path}.{key}", seen, found)
    return found


@pytest.mark.parametrize("executor", [EXECUTORS[0], "reference"], ids=["sdpa-no-host-skip", "reference"])
@pytest.mark.parametrize("criterion, source", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
def test_decode_steps_keep_no_tensor_they_made(model, reference, criterion, source, executor):
    """After the prefill every tensor qada keeps is updated in place: a decode step rebinds none and leaves no new
    one behind. Under CUDA graphs a tensor made in a captured step and kept past it would live in the graph's
    memory pool, overwritten by the next replay (torch refuses: "tensor(s) in the cudagraph pool not tracked")."""
    run = make_run(criterion, source, executor, reference)
    ids, mask = prompt()
    steps = 3
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 3)
    full_mask = torch.cat([mask, torch.ones(2, steps + 3, dtype=mask.dtype)], 1)
    attach(model, run)
    run.reset_stats()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            before = held_tensors(run)
            for _ in range(steps):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                out = model(input_ids=token, attention_mask=full_mask, past_key_values=cache, use_cache=True)
                after = held_tensors(run)
                assert {path for path in after if before.get(path) != after[path]} == set()
    finally:
        run.remove()


@pytest.mark.parametrize("executor", [EXECUTORS[0], "reference"], ids=["sdpa-no-host-skip", "reference"])
@pytest.mark.parametrize("criterion, source", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
def test_decode_steps_never_read_the_host(model, reference, criterion, source, executor):
    run = make_run(criterion, source, executor, reference)
    calls: list = []
    with count_buffer_steps(calls):
        tokens, _, summary = greedy(model, run, "static", steps=4, step_context=no_host_reads_in_decode_steps)
    assert len(calls) == 4 * model.config.num_hidden_layers
    assert summary["decode_steps"] == 4


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("criterion, source", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
def test_inference_mode(model, reference, criterion, source, cache_kind):
    """Inputs, cache and run all made inside ``torch.inference_mode()``, as most inference code does."""
    expected = greedy(model, make_run(criterion, source, "sdpa", reference), cache_kind, steps=4)
    with torch.inference_mode():
        got = greedy(model, make_run(criterion, source, "sdpa", reference), cache_kind, steps=4)
    assert torch.equal(got[0], expected[0])
    assert got[2]["sparsity"] == pytest.approx(expected[2]["sparsity"])


def test_generate_with_a_static_cache_under_inference_mode(model, reference):
    ids, mask = prompt()
    run = make_run({"name": "qada", "tau": 0.3}, "stored", "sdpa", reference)
    attach(model, run)
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                 cache_implementation="static", pad_token_id=0)
    finally:
        run.remove()
    assert out.shape == (2, 25)
    assert run.summary()["decode_steps"] == 4


def test_a_row_that_does_not_grow_by_one_is_reported():
    """Checked on the device during decoding (no sync), raised at the next host point (the summary)."""
    from qada.models.guards import CacheGuard

    guard = CacheGuard()
    guard.prefill(0, torch.zeros(2, 1, 20, 4))
    guard.start_buffer(torch.tensor([20, 20]))
    guard.decode_buffer(0, torch.tensor([21, 21]), first_layer=True)
    guard.check()  # fine so far
    guard.decode_buffer(0, torch.tensor([23, 22]), first_layer=True)  # row 0 grew by two keys
    with pytest.raises(StaleStateError, match="did not grow by exactly one key"):
        guard.check()
    guard.check()  # reported once


def test_a_decode_step_without_a_prefill_is_refused():
    from qada.models.guards import CacheGuard

    with pytest.raises(StaleStateError, match="without a prefill"):
        CacheGuard().decode_buffer(0, torch.tensor([21]), first_layer=True)


def greedy_compiled(model, run: QAdARun, steps: int, compile_kwargs: dict, device="cpu", seed: int = 3,
                    forward=None):
    """Eager prefill of :func:`prompt` (``seed``), then ``steps`` decode steps through ``forward`` (default: a new
    ``torch.compile(model.forward, **compile_kwargs)``): ``(tokens [2, steps], summary)``."""
    forward = forward or torch.compile(model.forward, **compile_kwargs)
    return decode_in_turns([model], [run], steps, [forward], device, seed)[0]


def decode_in_turns(models: list, runs: list[QAdARun], steps: int, forwards: list | None = None, device="cpu",
                    seed: int = 3) -> list[tuple]:
    """Each model with its run attached and its forward (default: its own ``torch.compile(model.forward,
    fullgraph=True)``): eager prefills of :func:`prompt` (``seed``), then ``steps`` decode steps in turns (model 0,
    model 1, ..., model 0, ...): ``[(tokens [2, steps], summary)]`` per model."""
    forwards = forwards or [torch.compile(model.forward, fullgraph=True) for model in models]
    ids, mask = (t.to(device) for t in prompt(seed))
    capacity = ids.shape[1] + steps + 3
    # the future slots are masked by causality: one 2D mask of the cache's size, no recompile
    full_mask = torch.cat([mask, torch.ones(2, capacity - ids.shape[1], dtype=mask.dtype, device=device)], 1)
    states = []
    try:
        with torch.no_grad():
            for model, run, forward in zip(models, runs, forwards, strict=True):
                attach(model, run)
                run.reset_stats()
                cache = StaticCache(config=model.config, max_cache_len=capacity)
                out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
                states.append([forward, cache, out.logits[:, -1].argmax(-1, keepdim=True), []])
            for _ in range(steps):
                for state in states:
                    forward, cache, token, tokens = state
                    tokens.append(token)
                    out = forward(input_ids=token, attention_mask=full_mask, past_key_values=cache, use_cache=True)
                    state[2] = out.logits[:, -1].argmax(-1, keepdim=True)
        return [(torch.cat(state[3], 1), run.summary()) for state, run in zip(states, runs, strict=True)]
    finally:
        for run in runs:
            run.remove()


COMPILED = [({"name": "qada", "tau": 0.3}, "stored", {"name": "sdpa", "host_skip": False})]
COMPILED_SLOW = [
    ({"name": "qada", "tau": 0.3}, "current", "sdpa"),
    ({"name": "qada", "tau": 0.3}, "bucketed", "reference"),
    ({"name": "qada_budget", "sparsity": 0.6}, "stored", {"name": "sdpa", "host_skip": False}),
    ({"name": "oracle", "tau": 0.3}, "none", "reference"),
]


@pytest.mark.parametrize("criterion, source, executor",
                         COMPILED + [pytest.param(*c, marks=pytest.mark.slow) for c in COMPILED_SLOW])
def test_a_decode_step_compiles_with_fullgraph_and_equals_eager(model, reference, criterion, source, executor):
    """``torch.compile(model.forward, fullgraph=True)`` with qada attached: no graph break (qada's step is one
    ``qada::decode_buffer`` operator), the same tokens and the same statistics as eager decoding; the state it
    updates in place (moments, statistics) is what a replayed step updates too."""
    torch._dynamo.reset()
    eager = greedy_compiled(model, make_run(criterion, source, executor, reference), 6, {"backend": "eager",
                                                                                          "disable": True})
    compiled = greedy_compiled(model, make_run(criterion, source, executor, reference), 6, {"fullgraph": True})
    assert torch.equal(compiled[0], eager[0])
    for key in ("sparsity", "kv_sparsity", "decode_steps", "fail_safe"):
        assert compiled[1][key] == pytest.approx(eager[1][key])
    assert 0.0 < compiled[1]["sparsity"] < 1.0


def test_a_compiled_step_gives_the_mask_to_its_first_global_layer_only(model, reference, monkeypatch):
    """In ``torch.compile(model.forward)``'s graph only the first global layer's ``qada::decode_buffer`` call takes
    the mask and the positions; the later ones take neither (Inductor copied them once per call on a GPU) and reuse
    the rows' bounds the first derived: derived once per step, the same tokens as when each layer has the mask."""
    import qada.models.masks as masks

    derived = []
    derive = masks.buffer_row_bounds
    monkeypatch.setattr(masks, "buffer_row_bounds", lambda *args: derived.append(1) or derive(*args))
    graphs = []

    def record(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    criterion, source, executor = COMPILED[0]
    compiled = greedy_compiled(model, make_run(criterion, source, executor, reference), 3,
                               {"backend": record, "fullgraph": True})
    calls = [node for node in graphs[-1].graph.nodes if "decode_buffer" in str(node.target)]
    assert len(calls) == model.config.num_hidden_layers > 1
    given = [(node.args[3] is not None, node.args[4] is not None) for node in calls]
    assert given[0] == (True, True) and set(given[1:]) == {(False, False)}
    assert len(derived) == 3  # once per step, not once per layer
    monkeypatch.setattr(masks, "buffer_row_bounds", derive)
    eager = greedy_compiled(model, make_run(criterion, source, executor, reference), 3,
                            {"backend": "eager", "disable": True})
    assert torch.equal(compiled[0], eager[0])


def test_row_bounds_given_no_mask_are_the_forwards_earlier_ones():
    """``RowBounds.bounds`` with neither mask nor positions: the bounds an earlier layer of the forward derived for
    the same buffer size; none (another size, or cleared at the forward's last layer): the missing-mask error."""
    from qada.models.guards import UnsupportedModelError
    from qada.models.masks import RowBounds

    rows = RowBounds()
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[1, ..., :3] = False
    start, end = rows.bounds(mask, 12, None)
    assert start.tolist() == [0, 3] and end.tolist() == [12, 12]
    again = rows.bounds(None, 12, None)
    assert again[0] is start and again[1] is end
    with pytest.raises(UnsupportedModelError, match="without an attention mask"):
        rows.bounds(None, 16, None)
    rows.clear()
    with pytest.raises(UnsupportedModelError, match="without an attention mask"):
        rows.bounds(None, 12, None)


def test_a_compiled_hybrid_model_shares_the_bounds_of_its_first_global_layer():
    """A hybrid model (Gemma-3: layers 2 and 5 global, the others sliding, with caches of their own size): the
    compiled step gives the mask to layer 2's call only, layer 5 reuses its bounds, and the tokens are the eager
    ones."""
    hybrid = tiny_model("gemma3")
    graphs = []

    def record(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    run = {"criterion": {"name": "qada", "tau": 0.3}, "moments": "current", "executor": "sdpa", "window": WINDOW}
    compiled = greedy_compiled(hybrid, build_run(**run), 3, {"backend": record, "fullgraph": True})
    calls = [node for node in graphs[-1].graph.nodes if "decode_buffer" in str(node.target)]
    assert [(node.args[6], node.args[3] is not None) for node in calls] == [(2, True), (5, False)]
    eager = greedy_compiled(hybrid, build_run(**run), 3, {"backend": "eager", "disable": True})
    assert torch.equal(compiled[0], eager[0])
    assert compiled[1]["sparsity"] == pytest.approx(eager[1]["sparsity"])


def test_two_models_compiled_side_by_side_each_call_their_own_run(model, reference):
    """Two copies of a model, each with its own run and its own compiled forward, decoding in turns: dynamo reuses
    one graph for every instance of a module class, so the graph is guarded on the run number each attention
    module carries; each copy's graph calls its own run (before: both called the first copy's run, whose state
    then moved twice a step and whose summary failed). Each run: the tokens and statistics of decoding alone."""
    torch._dynamo.reset()
    criterion, source, executor = COMPILED[0]
    alone = greedy_compiled(model, make_run(criterion, source, executor, reference), 4,
                            {"backend": "eager", "disable": True})
    copies = [model, copy.deepcopy(model)]
    runs = [make_run(criterion, source, executor, reference) for _ in copies]
    for tokens, summary in decode_in_turns(copies, runs, 4):
        assert torch.equal(tokens, alone[0])
        for key in ("sparsity", "kv_sparsity", "decode_steps"):
            assert summary[key] == pytest.approx(alone[1][key])
    assert all(not hasattr(module, "qada_run_number") for module in copies[1].modules())  # removed with the run


def test_a_compiled_forward_calls_the_run_attached_now(model, reference):
    """One compiled forward, two runs attached one after the other (the first still alive): the second run's
    steps go to the second run, with the tokens and statistics of eager decoding, and the first run's stay."""
    torch._dynamo.reset()
    criterion, source, executor = COMPILED[0]
    forward = torch.compile(model.forward, fullgraph=True)
    first_run = make_run(criterion, source, executor, reference)
    greedy_compiled(model, first_run, 3, {}, forward=forward)
    steps_before = first_run.summary()["decode_steps"]
    second = greedy_compiled(model, make_run({"name": "local"}, "none", executor, reference), 3, {},
                             forward=forward)
    alone = greedy_compiled(model, make_run({"name": "local"}, "none", executor, reference), 3,
                            {"backend": "eager", "disable": True})
    assert first_run.summary()["decode_steps"] == steps_before
    assert torch.equal(second[0], alone[0])
    assert second[1]["decode_steps"] == alone[1]["decode_steps"] == 3
    assert second[1]["sparsity"] == alone[1]["sparsity"] == 1.0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("executor", ["sdpa", "triton"])
@pytest.mark.parametrize("source", ["current", "stored", "bucketed"])
def test_gpu_decode_steps_never_sync(model, reference, source, executor):
    """On a GPU, with ``torch.cuda.set_sync_debug_mode("error")`` around qada's decode steps (from the second step
    on: the first compiles kernels, which may synchronise)."""
    on_gpu = copy.deepcopy(model).cuda()
    run = make_run({"name": "qada", "tau": 0.3}, source, executor, reference)
    original = QAdARun.decode
    calls = []

    def strict(self, *args, **kwargs):
        calls.append(1)
        if len(calls) <= on_gpu.config.num_hidden_layers:
            return original(self, *args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    QAdARun.decode = strict
    try:
        got = greedy_compiled(on_gpu, run, 6, {"disable": True}, device="cuda")
    finally:
        QAdARun.decode = original
    expected = greedy_compiled(model, make_run({"name": "qada", "tau": 0.3}, source, "sdpa", reference), 6,
                               {"disable": True})
    assert torch.equal(got[0].cpu(), expected[0])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("executor", ["sdpa", "triton"])
def test_gpu_cuda_graphs_replay_equals_eager(model, reference, executor):
    """``mode="reduce-overhead"`` (CUDA graphs): replayed steps give the eager tokens and statistics."""
    on_gpu = copy.deepcopy(model).cuda()
    torch._dynamo.reset()
    eager = greedy_compiled(on_gpu, make_run({"name": "qada", "tau": 0.3}, "stored", executor, reference), 8,
                            {"disable": True}, device="cuda")
    graphs = greedy_compiled(on_gpu, make_run({"name": "qada", "tau": 0.3}, "stored", executor, reference), 8,
                             {"mode": "reduce-overhead", "fullgraph": True}, device="cuda")
    assert torch.equal(graphs[0], eager[0])
    for key in ("sparsity", "kv_sparsity", "decode_steps"):
        assert graphs[1][key] == pytest.approx(eager[1][key])


def layer_inputs(run: QAdARun) -> dict[tuple, torch.Tensor]:
    """Every tensor the run's layer steps read besides their arguments (layer index, moment state, criterion
    states), by (layer, path)."""
    flat = {}

    def walk(path, value):
        if isinstance(value, torch.Tensor):
            flat[path] = value
        elif isinstance(value, dict):
            for name, item in value.items():
                walk((*path, name), item)
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                walk((*path, i), item)

    for layer, (_, inputs) in run._inputs.items():
        walk((layer,), inputs)
    return flat


@pytest.mark.parametrize("criterion, source", CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
def test_a_new_sequence_keeps_the_tensors_a_cuda_graph_reads(model, reference, criterion, source):
    """A run that decodes a second sequence on a preallocated cache of the same shape writes the new prefill's
    values into the first sequence's tensors (a CUDA graph recorded then replays on their addresses) and decodes
    exactly as a fresh run does."""
    run = make_run(criterion, source, "sdpa", reference)
    greedy(model, run, "static", steps=4)
    first = layer_inputs(run)  # held: their memory cannot be reused by the second sequence's tensors
    tokens, logits, summary = greedy(model, run, "static", steps=4, seed=5)
    second = layer_inputs(run)
    assert second.keys() == first.keys() and first
    moved = [key for key in first if (first[key].data_ptr(), first[key].stride()) != (second[key].data_ptr(),
                                                                                          second[key].stride())]
    assert not moved, moved
    index = getattr(run.criterion, "_index", None)
    for layer, (_, (_, _, states)) in run._inputs.items():  # the state the steps update is the criterion's own
        if index is not None:
            assert all(states[run.criterion.state_key][name] is getattr(index.layers[layer], name)
                       for name in ("member", "kmin", "kmax", "halves"))
    fresh_tokens, fresh_logits, fresh_summary = greedy(model, make_run(criterion, source, "sdpa", reference),
                                                       "static", steps=4, seed=5)
    assert torch.equal(tokens, fresh_tokens)
    torch.testing.assert_close(logits, fresh_logits)
    for key in ("sparsity", "kv_sparsity", "decode_steps", "fail_safe"):
        assert summary[key] == pytest.approx(fresh_summary[key])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("criterion", [{"name": "qada", "tau": 0.3}, {"name": "qada_tail", "tau": 0.3, "heavy": 4,
                                                                      "observe": 4, "page_size": 2, "pages": 2}],
                         ids=["qada", "qada_tail"])
def test_gpu_cuda_graphs_replay_a_second_sequence(model, reference, criterion):
    """One compiled forward (CUDA graphs) and one run over two sequences: the graphs recorded during the first
    replay the second on the tensors the run rewrote in place, and give a fresh eager run's tokens."""
    on_gpu = copy.deepcopy(model).cuda()
    torch._dynamo.reset()
    run = make_run(criterion, "stored", "triton", reference)
    forward = torch.compile(on_gpu.forward, mode="reduce-overhead", fullgraph=True)
    greedy_compiled(on_gpu, run, 8, {}, device="cuda", forward=forward)
    graphs = greedy_compiled(on_gpu, run, 8, {}, device="cuda", seed=5, forward=forward)
    eager = greedy_compiled(on_gpu, make_run(criterion, "stored", "triton", reference), 8, {"disable": True},
                            device="cuda", seed=5)
    assert torch.equal(graphs[0], eager[0])
    for key in ("sparsity", "kv_sparsity", "decode_steps"):
        assert graphs[1][key] == pytest.approx(eager[1][key])


def test_a_source_without_a_device_step_still_decodes(model, reference):
    """A plugin that implements only ``prefill/append/moments`` (the analysis API, no ``step_state``/``step``) keeps
    working: the default :meth:`~qada.moments.MomentSource.step` reads the layer's index on the host, and decides
    as the built-in source does."""

    from dataclasses import dataclass

    from qada.moments import MomentSource

    @dataclass
    class OnlyMoments(MomentSource):
        """A plugin of the analysis API: the built-in source behind it, reached through append/moments only."""

        def __post_init__(self):
            self.inner = StoredMoments(offset=12, min_bulk_keys=4)
            self.inner.set_reference(reference)

        def reset(self):
            self.inner.reset()

        def prefill(self, layer, keys, start, window, capacity=None):
            self.inner.prefill(layer, keys, start, window, capacity=capacity)

        def append(self, layer, keys, start, window, end=None):
            self.inner.append(layer, keys, start, window, end=end)

        def moments(self, layer, keys, start, window, end=None):
            return self.inner.moments(layer, keys, start, window, end=end)

    source = OnlyMoments()
    old = greedy(model, make_run({"name": "qada", "tau": 0.3}, source, "sdpa", reference), "static")
    new = greedy(model, make_run({"name": "qada", "tau": 0.3}, "stored", "sdpa", reference), "static")
    assert torch.equal(old[0], new[0]) and old[2]["sparsity"] == pytest.approx(new[2]["sparsity"])


def test_the_triton_executor_on_the_buffer_equals_the_reference(model, reference):
    """The ``triton`` kernel (Triton's interpreter here) on the whole buffer with the rows' ends as device tensors."""
    if not TRITON_INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    criterion = {"name": "qada", "tau": 0.3}
    sliced = greedy(model, make_run(criterion, "stored", "reference", reference), "dynamic", steps=4)
    calls: list = []
    with count_buffer_steps(calls), no_host_reads_in_decode_steps():
        buffered = greedy(model, make_run(criterion, "stored", "triton", reference), "static", steps=4)
    assert calls
    assert torch.equal(sliced[0], buffered[0])
    assert buffered[2]["sparsity"] == pytest.approx(sliced[2]["sparsity"])


def test_the_compiled_stored_step_equals_the_eager_one(model, reference):
    """:func:`advance_reference_range` is what CUDA runs compiled (a few fused kernels): the same state, here
    compiled by inductor for the CPU, over steps that add keys and one that jumps."""
    from qada.moments.stored import advance_reference_range

    source = moments("stored", reference)
    window = make_run("dense", "none", "sdpa", reference).window
    keys = torch.randn(2, 2, 15, 16)
    source.prefill(0, keys, torch.tensor([0, 5]), window, capacity=30)
    names = ("count", "s1", "s2", "old_end", "jump_n", "jump_count", "jump_s1", "jump_s2", "mean", "cov")
    declared = source.step_state(0)
    eager = tuple(declared[name].clone() for name in names)
    compiled = tuple(declared[name].clone() for name in names)
    step = torch.compile(advance_reference_range, dynamic=False)
    ref, shift = source._on(keys.device)
    for end in range(16, 24):  # row 1 (start 5) reaches 18 real tokens at end 23: its range jumps there
        n = torch.tensor([end, end - 5])
        for fn, state in ((advance_reference_range, eager), (step, compiled)):
            fn(*state, ref[0], shift[0], n, window.t_local, source.offset, window.t_sink, source.min_bulk_keys)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert eager[0][1].sum() > 0  # row 1 has a range after its jump


@pytest.mark.parametrize("source", ["current", "stored"])
def test_a_new_prompt_rewrites_the_state_in_place(model, reference, source):
    """A captured CUDA graph keeps writing the tensors it recorded: a second prompt on the same run rewrites the
    moment state, the guard's tensors and the statistics in place (same storage), and decides as a fresh run."""
    run = make_run({"name": "qada", "tau": 0.3}, source, "sdpa", reference)

    def storages():
        state = run.moments.step_state(0)
        if source == "stored":
            tensors = [state["count"], state["s2"], state["old_end"], state["cov"]]
        else:
            tensors = [state["m2"], state["out_cov"]]
        return [t.data_ptr() for t in tensors + [run.guard._last_end, run.guard._stale, run.stats.sums]]

    first = greedy(model, run, "static", steps=3)
    before = storages()
    second = greedy(model, run, "static", steps=3)
    assert storages() == before
    fresh = greedy(model, make_run({"name": "qada", "tau": 0.3}, source, "sdpa", reference), "static", steps=3)
    assert torch.equal(second[0], fresh[0]) and torch.equal(first[0], fresh[0])
    assert second[2]["sparsity"] == pytest.approx(fresh[2]["sparsity"])


@pytest.mark.parametrize("kind", ["stored", "bucketed"])
def test_a_reference_shorter_than_the_cache_may_need_warns_once_at_the_prefill(reference, kind):
    """Reported on the host's schedule (the prefill), never from inside a decode step."""
    source = moments(kind, reference)  # a reference of 64 keys; a full cache of 200 slots needs up to 188
    window = make_run("dense", "none", "sdpa", reference).window
    keys = torch.randn(1, 2, 20, 16)
    with pytest.warns(UserWarning, match="shorter than this prompt may need at the cache's capacity"):
        source.prefill(0, keys, None, window, capacity=200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source.prefill(0, keys, None, window, capacity=200)  # once per source
