"""The general layer step with the moment source's step as one Triton launch (``moment_launch``): what a run on the
``triton`` executor compiles for a GPU, where the source's torch step was several of Inductor's kernels. On the CPU
the launch runs in Triton's interpreter, eagerly: the same decisions, statistics and tokens as the torch step."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from tiny_models import tiny_model  # noqa: E402

from qada import step as step_module  # noqa: E402
from qada.attention import EXECUTORS, TritonExecutor, _triton_kernel  # noqa: E402
from qada.functional.capping import log_mean_exp_score  # noqa: E402
from qada.models.layer_step import LayerStep  # noqa: E402
from qada.moments.reference import collect_reference_keys  # noqa: E402
from tests.test_attention_triton import DEVICE  # noqa: E402
from tests.test_fused_decision import greedy, make_run  # noqa: E402
from tests.triton_launches import LaunchRecorder  # noqa: E402

CRITERIA = {"qada": {"name": "qada", "tau": 0.3}, "qada_tail": {"name": "qada_tail", "tau": 0.3, "page_size": 4}}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").to(DEVICE)


@pytest.fixture(scope="module")
def reference(model):
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    return collect_reference_keys(model, ids, chunk_size=16)


def count_score_moments(monkeypatch) -> list[int]:
    """A list that grows by one each time a step computes eq. 5-6's score moments in torch."""
    computed: list[int] = []
    score_moments = step_module.score_moments_unchecked
    monkeypatch.setattr(step_module, "score_moments_unchecked",
                        lambda *args: computed.append(1) or score_moments(*args))
    return computed


def assert_same_decode(tokens, summary, torch_tokens, torch_summary) -> None:
    """The launch's decode against the torch step's: the same tokens and statistics, some heads local and some not."""
    assert torch.equal(tokens, torch_tokens)
    for key in ("sparsity", "kv_sparsity", "kv_read"):
        assert summary[key] == pytest.approx(torch_summary[key], abs=1e-12), key
    assert 0.0 < summary["sparsity"] < 1.0  # not vacuous: some heads local, some dense


def test_the_triton_executor_asks_for_the_launch_on_a_gpu_only():
    """Not under Triton's interpreter (``torch.compile`` cannot trace it: the CPU's compiled steps stay torch); a
    run passes the executor's choice to its layer step, and the fused and dense steps do not take it."""
    executor = EXECUTORS.build("triton")
    assert executor.moment_launch is (not _triton_kernel.INTERPRETED)
    assert getattr(EXECUTORS.build("sdpa"), "moment_launch", False) is False
    run = make_run("current", {"name": "triton", "block_size": 16}, None)
    assert run.layer_step._bound["moment_launch"] is executor.moment_launch
    fused = make_run("current", {"name": "triton_fused", "block_size": 16}, None)
    assert "moment_launch" not in fused.layer_step._bound


@pytest.mark.parametrize("source", ["stored", "current"])
@pytest.mark.parametrize("criterion", sorted(CRITERIA))
def test_the_moment_launch_decides_as_the_torch_step(monkeypatch, model, reference, source, criterion):
    """The tiny model on ``triton`` (eager steps, a static cache): with the launch, each layer step launches the
    source's kernel once and the decode gives the torch step's tokens and statistics (the launch's moments and plain
    qada's estimate, written by the same launch, equal the torch step's up to float rounding; no ratio lies that
    close to tau here)."""
    executor = {"name": "triton", "block_size": 16}
    torch_tokens, torch_summary = greedy(model, make_run(source, executor, reference, CRITERIA[criterion]), "static",
                                         steps=3)
    monkeypatch.setattr(TritonExecutor, "moment_launch", property(lambda self: True))
    run = make_run(source, executor, reference, CRITERIA[criterion])
    assert run.layer_step._bound["moment_launch"] is True
    record = LaunchRecorder(monkeypatch)
    steps: list[list[str]] = []
    original = LayerStep.__call__

    def recorded(self, buffered, *args):
        launches = len(record.launches)
        result = original(self, buffered, *args)
        steps.append([name for name, _ in record.launches[launches:]])
        return result

    monkeypatch.setattr(LayerStep, "__call__", recorded)
    moments_computed = count_score_moments(monkeypatch)  # the plain qada criterion reads the launch's estimate instead
    with record:
        tokens, summary = greedy(model, run, "static", steps=3)
    assert steps and all(launches == [f"{source}_moment_step_kernel"] for launches in steps), steps
    assert (len(moments_computed) == 0) is (criterion == "qada"), len(moments_computed)  # qada_tail: its moments
    assert_same_decode(tokens, summary, torch_tokens, torch_summary)


@pytest.fixture(scope="module")
def capped_model():
    """A tiny Gemma-2 (two global layers) whose scores are soft-capped at 3: the cap bends most of them."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       layer_types=["full_attention"] * 2, attn_logit_softcapping=3.0,
                                       query_pre_attn_scalar=16, max_position_embeddings=256)
    model = transformers.Gemma2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():  # sharper attention than a fresh init, so that local and dense heads differ
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(4.0)
    return model.to(DEVICE)


TAU_CAPPED = 0.6


@pytest.mark.parametrize("source", ["stored", "current"])
def test_the_moment_launch_estimates_under_a_soft_cap(monkeypatch, capped_model, source):
    """Under a soft cap the launch writes ``log E[exp(c tanh(s / c))]`` from the Gauss-Hermite rule the executor
    holds (:meth:`~qada.attention.TritonExecutor.hermite_rule`), so plain qada computes no score moments in torch
    there either: the torch step's tokens and statistics (the estimate equal up to float rounding; no ratio lies that
    close to tau here), one launch per layer step."""
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    reference = collect_reference_keys(capped_model, ids, chunk_size=16)
    executor = {"name": "triton", "block_size": 16}
    criterion = {"name": "qada", "tau": TAU_CAPPED}
    torch_tokens, torch_summary = greedy(capped_model, make_run(source, executor, reference, criterion), "static",
                                         steps=3)
    monkeypatch.setattr(TritonExecutor, "moment_launch", property(lambda self: True))
    run = make_run(source, executor, reference, criterion)
    assert run.layer_step._bound["hermite"] == run.executor.hermite_rule
    record = LaunchRecorder(monkeypatch)
    score_moments = step_module.score_moments_unchecked  # (torch's, uncounted, for the estimates below)
    moments_computed = count_score_moments(monkeypatch)
    estimates = []  # (the launch's, torch's capped, the uncapped formula's) of every layer step, when it is taken
    take = step_module.DecodeStep.take_log_mean_exp

    def taking(step, log_mean_exp):
        mu, var = score_moments(step.query, *step.bulk_moments, step.scale)
        estimates.append((log_mean_exp.clone(), log_mean_exp_score(mu, var, step.softcap), mu + var / 2))
        return take(step, log_mean_exp)

    monkeypatch.setattr(step_module.DecodeStep, "take_log_mean_exp", taking)
    with record:
        tokens, summary = greedy(capped_model, run, "static", steps=3)
    assert len(estimates) == 2 * 3  # 2 layers, 3 steps
    for launched, capped, _ in estimates:  # Gauss-Hermite in the kernel against torch's quadrature
        torch.testing.assert_close(launched, capped.float(), atol=1e-4, rtol=1e-4)
    bent = max(float((capped - uncapped).abs().max()) for _, capped, uncapped in estimates)
    assert bent > 100 * 1e-4  # not vacuous: the cap bends the estimate far beyond that tolerance
    moment_launches = [name for name, _ in record.launches if name.endswith("moment_step_kernel")]
    assert moment_launches == [f"{source}_moment_step_kernel"] * (2 * 3), record.launches  # 2 layers, 3 steps
    assert not moments_computed  # the capped estimate came from the launch
    assert run.executor._hermite_held[0].device == next(capped_model.parameters()).device  # (held since the prefill)
    assert_same_decode(tokens, summary, torch_tokens, torch_summary)


def test_the_run_binds_no_rule_without_the_launch():
    """Without the moment launch (the CPU's interpreter) the general step estimates in torch, under a cap too."""
    run = make_run("current", {"name": "triton", "block_size": 16}, None)
    assert run.layer_step._bound["hermite"] is (run.executor.hermite_rule if run.executor.moment_launch else None)
