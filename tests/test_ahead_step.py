"""The layer step compiled ahead of time on the CPU (:mod:`qada.models.ahead_step`).

* decoding with it gives the eager step's tokens, statistics and in-place state, and a second run of the same
  configuration loads the package instead of compiling;
* a changed setting (``tau``) compiles again, as a guard of ``torch.compile`` would; another cache size than the
  first, or past :data:`MAX_ENTRIES` configurations, ``torch.compile``'s route takes over, still equal to eager;
* it declines where it cannot stand in for the guards: gradients, a tensor off the CPU, a user's component;
* its key and its flattening of the arguments follow ``torch.export``'s order.
"""

from __future__ import annotations

import dataclasses

import pytest
import test_buffer_decode
import torch
from test_buffer_decode import greedy as buffer_greedy
from test_layer_step import CONFIGS, STATISTICS, TopKPeaked, make_run

from qada.models.ahead_step import MAX_ENTRIES, AheadOfTimeStep, flatten_arguments, settings
from qada.models.layer_step import layer_step
from qada.window import Window

model, reference = test_buffer_decode.model, test_buffer_decode.reference  # the same model, reference, prompt


def decode(model, run, steps: int = 8):
    """Greedy decoding on a static cache without gradients (as ``generate`` decodes): ``(tokens, summary)``."""
    with torch.no_grad():
        tokens, _, summary = buffer_greedy(model, run, "static", steps)
    return tokens, summary


def states(model, run) -> list[dict[str, torch.Tensor]]:
    """Every layer's moment state and criterion states after decoding: the tensors the run passed its steps, which
    they update in place."""
    found = []
    for layer in range(model.config.num_hidden_layers):
        _, moment_state, criterion_states = run._kept_inputs[layer]
        state = dict(moment_state or {})
        for key, values in criterion_states.items():
            state.update({f"{key}.{name}": value for name, value in values.items()})
        found.append(state)
    return found


def assert_same(got, expected, rel: float = 1e-6) -> None:
    """Tokens identical; statistics equal up to float rounding (the fused kernels sum in another order)."""
    assert torch.equal(got[0], expected[0])
    for key in STATISTICS:
        assert got[1][key] == pytest.approx(expected[1][key], rel=rel, abs=1e-9), key


def ahead_of(run) -> AheadOfTimeStep:
    ahead = run.layer_step.ahead
    assert ahead is not None
    return ahead


def test_the_step_ahead_of_time_equals_eager_and_is_loaded_again(model, reference, tmp_path):
    """qada_tail on stored moments: the eager tokens, statistics and state; a second run loads the package."""
    criterion = CONFIGS["qada_tail"]
    eager_run = make_run(criterion, reference, False)
    expected = decode(model, eager_run)
    run = make_run(criterion, reference, True)
    ahead_of(run).folder = str(tmp_path)
    got = decode(model, run)
    ahead = ahead_of(run)
    assert (len(ahead.entries), ahead.declined, ahead.loaded) == (1, None, 0)
    assert len(list(tmp_path.glob("*.pt2"))) == 1
    assert_same(got, expected)
    for a, b in zip(states(model, eager_run), states(model, run), strict=True):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], equal_nan=True, msg=name)  # NaN: pages not begun
    again = make_run(criterion, reference, True)
    ahead_of(again).folder = str(tmp_path)
    assert_same(decode(model, again), expected)
    assert (len(ahead_of(again).entries), ahead_of(again).loaded) == (1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name, source", [("qada", "current"), ("qada_tail_budget", "stored"),
                                          ("layer_override", "stored")])
def test_built_in_criteria_step_ahead_of_time_as_eager(model, reference, name, source):
    """Current moments, a budget, and an extra set merged after the executor (qada stored and qada_tail stored are
    the other tests'); each compile takes ~20 s on a cold cache, so the matrix stays short."""
    expected = decode(model, make_run(CONFIGS[name], reference, False, source))
    run = make_run(CONFIGS[name], reference, True, source)
    got = decode(model, run)
    assert (len(ahead_of(run).entries), ahead_of(run).declined) == (1, None)
    assert_same(got, expected)


@pytest.mark.slow
def test_a_new_setting_compiles_again_another_size_or_past_the_limit_goes_to_torch_compile(model, reference,
                                                                                          tmp_path):
    """tau 0.3 at the first cache size; 5 steps (another size): torch.compile's route; tau 0.9: compiled again at the
    first size; tau 0.5: past the limit, torch.compile's route. Every decode equals the eager one."""
    run = make_run(CONFIGS["qada"], reference, True)
    ahead_of(run).folder = str(tmp_path)
    for tau, steps, entries, declined in ((0.3, 8, 1, None), (0.3, 5, 1, "another cache size"), (0.9, 8, 2, None),
                                          (0.5, 8, MAX_ENTRIES, "more than")):
        run.criterion.tau = tau
        ahead_of(run).declined = None
        got = decode(model, run, steps)
        assert_same(got, decode(model, make_run({"name": "qada", "tau": tau}, reference, False), steps))
        assert len(ahead_of(run).entries) == entries
        if declined is None:
            assert ahead_of(run).declined is None
        else:
            assert declined in ahead_of(run).declined
    assert run.layer_step.compiled  # torch.compile's route, not eager


def step_arguments(batch: int = 1, requires_grad: bool = False) -> tuple:
    """A layer step's positional arguments of the shapes a run passes (no moments, one criterion)."""
    query = torch.randn(batch, 4, 1, 8, requires_grad=requires_grad)
    keys, values = torch.randn(batch, 2, 32, 8), torch.randn(batch, 2, 32, 8)
    end = torch.full((batch,), 20)
    states = {"criterion": {"counts": torch.zeros(2), "peak": torch.ones(2, 3)}}
    return (query, keys, values, None, end, 0.35, torch.tensor(0), None, states, None, None, torch.zeros(2, 5))


def test_arguments_flatten_in_the_order_of_torch_export():
    from torch.utils import _pytree as pytree

    args = step_arguments()
    leaves, structure = flatten_arguments(args)
    exported = [leaf for leaf in pytree.tree_flatten(args)[0] if isinstance(leaf, torch.Tensor)]
    assert len(leaves) == len(exported) and all(a is b for a, b in zip(leaves, exported, strict=True))
    assert structure == (True, True, True, None, True, 0.35, True, None, (("criterion", ("counts", "peak")),),
                         None, None, True)


def test_the_key_follows_shapes_settings_and_threads_and_refuses_gradients_and_other_devices():
    criterion = TopKPeaked(sparsity=0.5)
    window = Window(t_local=8, t_sink=2)
    ahead = AheadOfTimeStep(layer_step, {}, [window])
    key = ahead.key(*flatten_arguments(step_arguments()))
    assert key is not None and key == ahead.key(*flatten_arguments(step_arguments()))
    assert ahead.key(*flatten_arguments(step_arguments(batch=2))) != key
    with torch.enable_grad():
        assert ahead.key(*flatten_arguments(step_arguments(requires_grad=True))) is None
    with torch.no_grad():
        assert ahead.key(*flatten_arguments(step_arguments(requires_grad=True))) is not None
    off_cpu = list(step_arguments())
    off_cpu[0] = torch.empty(1, 4, 1, 8, device="meta")  # a tensor on another device (no GPU needed to say so)
    assert ahead.key(*flatten_arguments(tuple(off_cpu))) is None
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert ahead.key(*flatten_arguments(step_arguments())) != key
    finally:
        torch.set_num_threads(threads)
    assert settings(criterion) != settings(dataclasses.replace(criterion, sparsity=0.25))


def test_a_component_of_a_users_declines():
    """A user's criterion may read attributes that are not its fields: torch.compile's guards keep watching it."""
    ahead = AheadOfTimeStep(layer_step, {}, [TopKPeaked(sparsity=0.5), Window(t_local=8, t_sink=2)])
    assert not ahead.own and ahead(step_arguments()) is None and "qada's own" in ahead.declined


def test_the_tensor_guard_refuses_another_dtype_shape_strides_device_or_gradients():
    from qada.models.ahead_step import tensor_guard

    leaves = list(flatten_arguments(step_arguments())[0])
    guard = tensor_guard(leaves)
    assert guard is not None and guard.check(*[tensor.clone() for tensor in leaves])
    changes = {"dtype": leaves[0].double(), "shape": torch.randn(1, 4, 1, 9),
               "strides": torch.randn(1, 4, 8, 1).transpose(2, 3), "device": leaves[0].to("meta"),
               "gradients": leaves[0].clone().requires_grad_()}
    for name, tensor in changes.items():
        assert not guard.check(tensor, *leaves[1:]), name
    resized = leaves[1].clone()
    assert guard.check(leaves[0], resized, *leaves[2:])
    resized.resize_(1, 2, 33, 8)  # the same tensor, changed in place
    assert not guard.check(leaves[0], resized, *leaves[2:])


def test_without_torchs_tensor_guard_every_call_takes_the_key(monkeypatch):
    """A torch without ``TensorGuards`` (a private API): no guard, no fast path, the key is made on every call."""
    from qada.criteria.qada import QAdACriterion
    from qada.models import ahead_step

    monkeypatch.setattr(ahead_step, "_tensor_guards", lambda: None)
    ahead = AheadOfTimeStep(layer_step, {}, [QAdACriterion(tau=0.6), Window(t_local=8, t_sink=2)])
    leaves, structure = flatten_arguments(step_arguments())
    assert ahead_step.tensor_guard(leaves) is None
    key = ahead.key(leaves, structure)
    assert key.threads == torch.get_num_threads() and key.dtype == torch.get_default_dtype()
    ahead._remember(leaves, key, "entry")
    assert ahead._recent is None and ahead._recent_entry(leaves, structure, ahead.configuration()) is None


def test_the_fast_path_takes_the_last_entry_only_where_the_key_is_the_same():
    """The next call skips the Python key where nothing in it changed: the settings, the tensors' metadata (checked
    in C++), the threads, the default dtype, the gradient mode and the arguments' structure; anything else goes to
    the full key (and compiles or declines as before)."""
    from qada.criteria.qada import QAdACriterion

    criterion = QAdACriterion(tau=0.6)
    ahead = AheadOfTimeStep(layer_step, {}, [criterion, Window(t_local=8, t_sink=2)])

    def fast(args: tuple) -> object:
        leaves, structure = flatten_arguments(args)
        return ahead._recent_entry(leaves, structure, ahead.configuration())

    args = step_arguments()
    leaves, structure = flatten_arguments(args)
    with torch.no_grad():
        ahead._remember(leaves, ahead.key(leaves, structure), "entry")
        assert fast(args) == "entry" and fast(step_arguments()) == "entry"  # new tensors of the same kind
        assert fast(step_arguments(batch=2)) is None
        states = dict(args[8]["criterion"])
        states["other"] = torch.zeros(2)
        assert fast(args[:8] + ({"criterion": states},) + args[9:]) is None  # another structure
        criterion.tau = 0.3
        assert fast(args) is None
        criterion.tau = 0.6
        assert fast(args) == "entry"
        torch.set_num_threads(torch.get_num_threads() + 1)
        try:
            assert fast(args) is None
        finally:
            torch.set_num_threads(torch.get_num_threads() - 1)
    with torch.enable_grad():
        assert fast(args) is None
