"""Decisions on two devices (qada.eval.parity): the comparison on the CPU, and the CPU against CUDA on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from qada.eval.parity import compare_decisions, decision_parity, record_decisions
from tests.tiny_models import tiny_model

QADA = {"name": "qada", "tau": 0.42}  # the tiny model's ratios lie near 0.4-0.45: half its heads local


def _decisions(*rows):
    return {(layer, step): torch.tensor(value, dtype=torch.bool) for layer, step, value in rows}


def test_compare_counts_mismatches_and_excuses_only_heads_near_tau():
    reference = _decisions((0, 0, [[True, False, True]]), (1, 0, [[False, False, True]]))
    other = _decisions((0, 0, [[False, False, True]]), (1, 0, [[False, True, True]]))
    # the reference flips head 0 of layer 0 between tau - delta and tau + delta: near tau; layer 1's head 1 does not
    below = _decisions((0, 0, [[True, False, True]]), (1, 0, [[False, False, True]]))
    above = _decisions((0, 0, [[False, False, True]]), (1, 0, [[False, False, True]]))
    report = compare_decisions(reference, other, below, above)
    assert (report.decisions, report.mismatched, report.near_tau, report.unexplained) == (6, 2, 1, 1)
    assert report.per_layer == {0: 0, 1: 1}
    assert not report.equal
    assert report.sparsity == {"reference": 3 / 6, "other": 3 / 6}
    plain = compare_decisions(reference, other)  # no band: every mismatch is unexplained
    assert (plain.near_tau, plain.unexplained) == (0, 2)


def test_compare_reports_steps_decided_on_one_device_only():
    reference = _decisions((0, 0, [[True]]), (0, 1, [[True]]))
    report = compare_decisions(reference, _decisions((0, 0, [[True]])))
    assert report.missing == [(0, 1)] and report.unexplained == 0 and not report.equal
    with pytest.raises(ValueError, match="both"):
        compare_decisions(reference, reference, below=reference)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=3)
    ids = torch.randint(3, model.config.vocab_size, (1, 300))
    return model, ids


def test_record_decisions_covers_every_layer_and_step(tiny):
    model, ids = tiny
    decisions, described = record_decisions(model, ids, [5, 6, 7], QADA, moments="current", compile=False)
    assert sorted(decisions) == [(layer, step) for layer in range(3) for step in range(3)]
    assert all(d.dtype == torch.bool and d.shape == (1, model.config.num_attention_heads) for d in decisions.values())
    assert described["moments"] == {"name": "current"} and described["criterion"]["tau"] == 0.42
    with pytest.raises(ValueError, match="continuation"):
        record_decisions(model, ids, [], QADA, moments="current")


def test_parity_of_a_copy_is_exact_and_a_changed_layer_is_found(tiny):
    model, ids = tiny
    same, described = decision_parity(model, copy.deepcopy(model), ids, [5, 6, 7, 8], QADA, moments="current",
                                      compile=False)
    assert same.equal and same.mismatched == 0 and same.decisions == 3 * 4 * model.config.num_attention_heads
    assert 0.2 < same.sparsity["reference"] < 0.8  # mixed decisions: a change can show
    assert described["reference"]["moments"] == described["other"]["moments"]
    changed = copy.deepcopy(model)
    with torch.no_grad():  # layer 1's keys change: its decisions (and those after it) are not rounding
        changed.model.layers[1].self_attn.k_proj.weight.mul_(3.0)
    report, _ = decision_parity(model, changed, ids, [5, 6, 7, 8], QADA, moments="current", compile=False,
                                delta=0.001)
    assert report.per_layer[0] == 0
    assert report.unexplained > 0 and not report.equal


def test_compiled_layer_step_decides_as_the_eager_one(tiny):
    """The same device, the layer step compiled against eager: the parity machinery on the one difference a CPU
    has (the compiled step's fused arithmetic)."""
    model, ids = tiny
    eager, _ = record_decisions(model, ids, [5, 6, 7], QADA, moments="current", compile=False)
    compiled, _ = record_decisions(model, ids, [5, 6, 7], QADA, moments="current", compile=True)
    below, _ = record_decisions(model, ids, [5, 6, 7], {**QADA, "tau": 0.41}, moments="current", compile=False)
    above, _ = record_decisions(model, ids, [5, 6, 7], {**QADA, "tau": 0.43}, moments="current", compile=False)
    assert compare_decisions(eager, compiled, below, above).equal


@pytest.mark.parametrize("criterion", [QADA, {"name": "qada_tail", "tau": 0.42}], ids=["qada", "qada_tail"])
def test_fused_kernel_decides_as_the_torch_path(tiny, criterion):
    """The parity check the GPU runs for ``triton_fused`` (the decision inside the split kernel), on the CPU with
    Triton's interpreter: its decisions equal the torch path's (``sdpa``) outside the band around tau."""
    pytest.importorskip("triton", reason="triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernel runs compiled, on CUDA: test_cuda_decides_as_the_cpu checks it there")
    model, ids = tiny
    tau = criterion["tau"]

    def decide(value, executor):
        return record_decisions(model, ids, [5, 6, 7], {**criterion, "tau": value}, moments="current",
                                compile=False, executor=executor)

    reference, _ = decide(tau, "sdpa")
    band = decide(tau - 0.01, "sdpa")[0], decide(tau + 0.01, "sdpa")[0]
    executors = [{"name": "triton_fused", "block_size": 16}]
    if criterion["name"] == "qada":  # the estimate in the splits, the moments a step ahead (a plain decision only)
        executors.append({"name": "triton_fused", "block_size": 16, "estimate_in_splits": True})
    for executor in executors:
        fused, described = decide(tau, executor)
        report = compare_decisions(reference, fused, *band)
        assert described["executor"]["name"] == "triton_fused"
        assert report.equal and report.decisions == 3 * 3 * model.config.num_attention_heads, (executor, report)
        assert 0.2 < report.sparsity["other"] < 0.8


def test_describe_names_the_stored_reference_file_and_fingerprint(tiny, tmp_path):
    """A run's description says which reference its stored moments read: the file and the model fingerprint (what a
    GPU run and a CPU run must share to decide alike); before it is prepared, only what was configured."""
    from qada.artifacts import model_fingerprint
    from qada.models import build_run, prepare_run
    from qada.moments.reference import collect_reference_keys, fingerprint_key

    model, ids = tiny
    file = tmp_path / "reference.safetensors"
    collect_reference_keys(model, ids[:, :200], info={"prompt": "random_words"}).save(file)
    run = build_run(criterion=QADA, moments={"name": "stored", "path": str(file)}, executor="sdpa")
    assert run.describe()["moments"] == {"name": "stored", "prompt": "random_words", "seed": 0, "offset": 1024,
                                         "path": str(file)}
    described = prepare_run(run, model).describe()
    assert described["moments"]["file"] == "reference.safetensors" and described["moments"]["length"] == 200
    assert described["moments"]["fingerprint"] == fingerprint_key(model_fingerprint(model.config, model))
    assert (described["criterion"]["name"], described["criterion"]["tau"]) == ("qada", 0.42)
    assert described["executor"]["name"] == "sdpa"
    assert build_run(criterion="oracle", moments="stored", executor="sdpa").describe()["moments"] is None


# --- on a GPU: the CPU's decisions against CUDA's, the embedded model ---------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def smollm2_pair():
    from qada.eval.passkey import passkey_prompt
    from qada.models.loading import load_model

    cpu, tokenizer = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    gpu, _ = load_model("smollm2-135m", dtype=torch.float32, device="cuda")
    ids = passkey_prompt(tokenizer, length=2048, depth=0.5, seed=0).input_ids[:, :2048]
    with torch.no_grad():
        out = cpu.generate(ids, max_new_tokens=8, do_sample=False)
    return cpu, gpu, tokenizer, ids, out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def cpu_decisions(smollm2_pair):
    """The CPU's decisions (eager: the reference every CUDA case is held to), each configuration decoded once."""
    cpu, _, tokenizer, ids, continuation = smollm2_pair
    done = {}

    def decide(criterion, moments, tau):
        key = (criterion["name"], moments, tau)
        if key not in done:
            done[key] = record_decisions(cpu, ids, continuation, {**criterion, "tau": tau}, moments, tokenizer,
                                         compile=False, executor="sdpa")
        return done[key]

    return decide


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("executor", ["triton", "triton_fused", "triton_fused compile_step", "triton_fused estimating"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("moments", ["stored", "current"])
@pytest.mark.parametrize("criterion", [{"name": "qada", "tau": 0.6}, {"name": "qada_tail", "tau": 0.3}],
                         ids=["qada", "qada_tail"])
def test_cuda_decides_as_the_cpu(smollm2_pair, cpu_decisions, criterion, moments, compile, executor):
    """Every layer's decisions on CUDA (the ``triton`` executor after the torch decision, or ``triton_fused``
    deciding inside its kernel; eager or compiled) equal the CPU's eager ones on the same prompt, tokens and dtype,
    except heads whose ratio lies within 0.01 of tau; both read the same stored reference (file and fingerprint).
    ``triton_fused compile_step``: the fused layer step compiled by Inductor (not the default: on an H200 it decided
    4 of a tiny model's 96 head-steps otherwise than the eager step; this case says whether those lie near tau).
    ``triton_fused estimating``: the estimate in every split, the moment step a decode step ahead in the combine
    launch (``estimate_in_splits``: a plain ``qada`` decision only)."""
    if executor.endswith("compile_step"):
        if not compile:
            pytest.skip("compile_step applies to a compiled run")
        executor = {"name": "triton_fused", "compile_step": True}
    elif executor.endswith("estimating"):
        if criterion["name"] != "qada":
            pytest.skip("estimate_in_splits applies to a plain qada decision")
        executor = {"name": "triton_fused", "estimate_in_splits": True}
    _, gpu, tokenizer, ids, continuation = smollm2_pair
    tau = criterion["tau"]
    reference, described_reference = cpu_decisions(criterion, moments, tau)
    other, described_other = record_decisions(gpu, ids, continuation, criterion, moments, tokenizer, compile,
                                              executor)
    report = compare_decisions(reference, other, cpu_decisions(criterion, moments, tau - 0.01)[0],
                               cpu_decisions(criterion, moments, tau + 0.01)[0])
    print(f"{criterion['name']} {moments} {executor} compile={compile}: {report}")
    assert report.equal, report
    assert abs(report.sparsity["reference"] - report.sparsity["other"]) <= 0.02
    assert described_other["executor"]["name"] == (executor if isinstance(executor, str) else executor["name"])
    ref, other_moments = described_reference["moments"], described_other["moments"]
    if moments == "stored":
        named = ("prompt", "file", "fingerprint")
        assert [ref[k] for k in named] == [other_moments[k] for k in named]
