"""The ``auto`` executor: the choice by device, dtype and criterion, and a run that resolves it."""

import importlib.util

import pytest
import torch

from qada.attention import (
    EXECUTORS,
    AutoExecutor,
    FusedTritonExecutor,
    SDPAExecutor,
    TritonExecutor,
    decode_attention,
)
from qada.attention.auto import executor_for
from qada.models import apply, build_run
from qada.models.apply import weights_placement
from tests.tiny_models import tiny_model

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("device, dtype, fusable, triton, expected", [
    (CPU, torch.float32, True, True, "sdpa"),
    (CPU, torch.bfloat16, False, True, "sdpa"),
    (torch.device("meta"), torch.bfloat16, True, True, "sdpa"),
    (CUDA, torch.float64, True, True, "sdpa"),
    (CUDA, torch.bfloat16, True, False, "sdpa"),
    (CUDA, torch.bfloat16, True, True, "triton_fused"),
    (torch.device("cuda", 1), torch.float16, True, True, "triton_fused"),
    (CUDA, torch.float32, False, True, "triton"),
])
def test_executor_for_picks_by_device_dtype_and_criterion(device, dtype, fusable, triton, expected):
    name, reason = executor_for(device, dtype, fusable, triton_installed=triton)
    assert name == expected and reason
    assert name in EXECUTORS.names()


def test_executor_for_says_why():
    assert "cpu" in executor_for(CPU, torch.float32, True)[1]
    assert "float64" in executor_for(CUDA, torch.float64, True, triton_installed=True)[1]
    assert "not installed" in executor_for(CUDA, torch.bfloat16, True, triton_installed=False)[1]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton installed")
def test_a_triton_older_than_the_kernels_need_gets_sdpa(monkeypatch):
    """Triton before 3.3 (the kernels not checked with its compiler): ``auto`` keeps ``sdpa`` and says why."""
    from qada.attention import triton_decode

    assert executor_for(CUDA, torch.bfloat16, True)[0] == "triton_fused"
    monkeypatch.setattr(triton_decode, "triton_version", lambda: (3, 2))
    name, reason = executor_for(CUDA, torch.bfloat16, True)
    assert name == "sdpa" and "Triton 3.2 is older than the kernels need (3.3" in reason


def test_auto_is_the_default_of_a_run():
    run = build_run(criterion="qada", moments="current")
    assert isinstance(run.executor, AutoExecutor)


def test_standalone_auto_attends_as_the_reference_on_the_cpu():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 1, 32, generator=g), torch.randn(2, 3, 300, 32, generator=g),
               torch.randn(2, 3, 300, 32, generator=g))
    local = torch.tensor([[True, True, True, False, True, True], [True] * 6])
    executor = EXECUTORS.build("auto")
    got = decode_attention(executor, q, k, v, local)
    expected = decode_attention(EXECUTORS.build("reference"), q, k, v, local)
    torch.testing.assert_close(got.output, expected.output, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.local, expected.local)
    assert [type(chosen) for chosen in executor._chosen.values()] == [SDPAExecutor]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton installed")
@pytest.mark.parametrize("criterion, moments, expected", [
    ({"name": "qada", "tau": 0.3}, "current", FusedTritonExecutor),
    ({"name": "qada_tail", "tau": 0.3}, "stored", FusedTritonExecutor),
    ({"name": "qada_tail_budget", "sparsity": 0.8}, "stored", FusedTritonExecutor),
    ({"name": "oracle", "tau": 0.3}, "none", TritonExecutor),
    ("dense", "none", TritonExecutor),
    ({"name": "qada_budget", "sparsity": 0.8}, "stored", FusedTritonExecutor),
    ("local", "none", TritonExecutor),
])
def test_a_run_on_cuda_resolves_auto_by_its_criterion(criterion, moments, expected):
    """Resolved for a CUDA model without one: building the chosen executor touches no device. The layer step is the
    executor's own where it fuses the decision, and for the ``dense`` criterion on ``triton`` (its dense step)."""
    run = build_run(criterion=criterion, moments=moments, executor={"name": "auto", "group_policy": "promote"})
    run.resolve_executor(CUDA, torch.bfloat16)
    assert type(run.executor) is expected and run.executor.group_policy == "promote"
    assert run.executor_choice.startswith(f"auto chose {run.executor.registry_name}: ")
    assert run.describe()["executor"]["name"] == run.executor.registry_name
    assert run.describe()["executor_choice"] == run.executor_choice
    assert (run.layer_step.fused is run.executor) == (expected is FusedTritonExecutor or criterion == "dense")


def test_a_named_executor_stays():
    run = build_run(criterion="qada", moments="current", executor="sdpa")
    named = run.executor
    run.resolve_executor(CUDA, torch.bfloat16)
    assert run.executor is named and run.executor_choice is None and "executor_choice" not in run.describe()


def test_weights_placement():
    assert weights_placement(torch.nn.Linear(2, 2).to(torch.bfloat16)) == (CPU, torch.bfloat16)
    assert weights_placement(torch.nn.Module()) == (CPU, torch.float32)
    spread = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    assert weights_placement(spread) == (CPU, torch.float32)
    integer_first = torch.nn.Module()
    integer_first.register_parameter("steps", torch.nn.Parameter(torch.zeros(2, dtype=torch.long),
                                                                 requires_grad=False))
    integer_first.linear = torch.nn.Linear(2, 2, dtype=torch.float16)
    assert weights_placement(integer_first) == (CPU, torch.float16)


def _greedy(model, ids, steps=12):
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         pad_token_id=0)
    return out


def test_apply_on_the_cpu_chooses_sdpa_and_decodes_as_it():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(3))
    with apply(model, criterion={"name": "qada", "tau": 0.1}, moments="current", window={"t_local": 32, "t_sink": 4},
               executor="sdpa") as named:
        expected = _greedy(model, ids)
    with apply(model, criterion={"name": "qada", "tau": 0.1}, moments="current",
               window={"t_local": 32, "t_sink": 4}) as run:
        assert type(run.executor) is SDPAExecutor and "on cpu" in run.executor_choice
        got = _greedy(model, ids)
    assert torch.equal(got, expected)
    assert run.summary()["sparsity"] == named.summary()["sparsity"] > 0


@pytest.mark.gpu
def test_apply_on_cuda_chooses_the_fused_kernels_and_decodes_as_them():
    model = tiny_model("llama").to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(3)).cuda()
    kwargs = dict(criterion={"name": "qada", "tau": 0.3}, moments="current", window={"t_local": 32, "t_sink": 4})
    with apply(model, executor="triton_fused", **kwargs) as named:
        expected = _greedy(model, ids)
    with apply(model, **kwargs) as run:
        assert type(run.executor) is FusedTritonExecutor
        got = _greedy(model, ids)
    assert torch.equal(got, expected)
    assert run.summary()["sparsity"] == named.summary()["sparsity"]
