"""What qada's Triton kernels ask of a Hopper GPU, checked on the CPU (``benchmarks/kernel_resources.py``): every
kernel a decode step launches, compiled for sm_90 with the step's own arguments, spills at most a few words per thread
and leaves room for three programs per SM (the split heuristic plans about two per SM, plus a partial wave; two for the
moment step's kernels, one program per (row, KV head)), and the
fused splits' attention loop is software-pipelined as the plain split's.

Before this check the fused split kernels at Llama-3-8B head shapes spilled over 11 KB per thread (a float32 ``ieee``
dot of the queries and a whole key tile holds both operands' rows in registers); a kernel that spills in its loops
cannot read the cache at bandwidth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ROOT = Path(__file__).resolve().parent.parent

MAX_SPILL_BYTES = 64
MIN_PROGRAMS_PER_SM = 3  # at head size 128 and below; at 256 (Gemma-2, Gemma-3) 2: twice the registers per tile
ROW_HEAD_KERNELS = {"current_moment_step_kernel": 2, "stored_moment_step_kernel": 2, "bulk_estimate_kernel": 2,
                    "qada_tail_page_top_kernel": 2}
"""Kernels of few programs, whose time is a chain of dependent loads rather than their grid's occupancy: the moment
step's, one program per (row, KV head), never split, whose grid fills two programs per SM of a 132-SM GPU only
beyond 264 (row, KV head) pairs (SmolLM2 at batch 88, Llama-3-8B at 33). They spend registers on 32 x 32 block pairs
of their float64 state instead (three block pairs at d = 64 where blocks of 16 took ten, each a round of dependent
loads: what a launch of few programs waits for), and need two programs per SM. And the page-top programs, one per
(row, KV head, stretch of 256 pages: two at 7.68k, 32 at 128k), which hold two tiles of page extrema (the next one
loads while the current one is bounded: one round trip a program instead of one a tile), run by the launch that
writes ``log E[exp(s)]`` (``PAGE_TOPS``: a moment step's or the estimate's kernel) or by a launch of their own."""

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{root!r}]
    import torch, transformers
    from benchmarks.compile_trace import pretend_cuda_triton
    from benchmarks.kernel_resources import (H100_SMS, Sm90Compiler, compile_steps, pretend_programmatic_launch,
                                             use_sm_count)
    pretend_cuda_triton()
    pretend_programmatic_launch()
    use_sm_count(H100_SMS)  # the splits an H100 gets
    from qada.attention import _triton_kernel

    compiler = Sm90Compiler({float_scalars!r})
    _triton_kernel.run = compiler
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    # SmolLM2's and Llama-3-8B's attention, and Gemma-2-9B's (d = 256, soft-capped scores; global layers only)
    for heads, kv_heads, head_dim in {shapes!r}:
        shape = dict(hidden_size=heads * 32, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=256, vocab_size=128)
        torch.manual_seed(0)
        if head_dim == 256:
            config = transformers.Gemma2Config(**shape, num_hidden_layers=1, layer_types=["full_attention"],
                                               attn_logit_softcapping=50.0, attn_implementation="eager")
            model = transformers.Gemma2ForCausalLM(config)
        else:
            config = transformers.LlamaConfig(**shape, num_hidden_layers=1, attn_implementation="sdpa")
            model = transformers.LlamaForCausalLM(config)
        model = model.to(torch.bfloat16).eval()
        for capacity in (256, 4160):  # one page range per split, and the page bounds spread (> 256 pages)
            compile_steps(compiler, f"d={{head_dim}} G={{heads // kv_heads}} C={{capacity}}", model, None, ids,
                          "current", capacity)
    print("RESULT", json.dumps(list(compiler.kernels.values())))
    """
)


def compile_decode_steps(float_scalars: str = "fp32",
                         shapes: tuple = ((9, 3, 64), (32, 8, 128), (16, 8, 256))) -> list[dict]:
    """Every kernel a decode step launches (each configuration of the benchmark, at each of ``shapes``: heads, KV
    heads, head size), compiled for sm_90 with Python floats passed as ``float_scalars``, in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["QADA_COMPILE"] = "0"
    script = SCRIPT.format(root=str(ROOT), float_scalars=float_scalars, shapes=shapes)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compile_decode_steps()


@pytest.mark.slow
def test_kernels_compile_as_torch_compile_launches_them():
    """A kernel launched from a function ``torch.compile`` compiled gets a Python float as fp64 (Triton's launcher:
    fp32). Every kernel of a decode step compiles so, at SmolLM2's and Gemma-2's (soft-capped) head shapes, and
    computes in float32 all the same: before the kernels cast their float arguments, the window scores became
    float64 and the fused kernels did not compile ("Loop-carried variable m has initial type fp32 but is re-assigned
    to fp64"; Inductor on an H200), so the compiled layer step fell back to eager inside a CUDA graph's recording."""
    kernels = compile_decode_steps("fp64", ((9, 3, 64), (16, 8, 256)))
    names = {k["kernel"] for k in kernels}
    assert names >= {"qada_fused_split_kernel", "qada_tail_fused_split_kernel", "current_moment_step_kernel",
                     "qada_decode_split_kernel", "qada_decode_combine_kernel", "qada_budget_score_kernel"}, names
    assert any(k["kernel"] == "qada_decode_split_kernel" and k["flags"].get("RANK") for k in kernels)
    assert any(k["flags"].get("PAGE_TOPS") for k in kernels), "no launch ran page-top programs"
    assert any(k["flags"].get("SOFTCAP") for k in kernels)


@pytest.mark.slow
def test_every_kernel_of_a_decode_step_was_compiled(kernels):
    names = {k["kernel"] for k in kernels}
    assert names >= {"qada_decode_split_kernel", "qada_decode_combine_kernel", "current_moment_step_kernel",
                     "qada_fused_split_kernel", "qada_tail_fused_split_kernel", "qada_budget_score_kernel"}
    assert any(k["kernel"] == "qada_decode_split_kernel" and k["flags"].get("RANK") for k in kernels)
    # a qada_tail decision launched apart at batch size 1 on an H100's 132 SMs: one program per query head, the
    # group policy in the split after it
    assert any(k["kernel"] == "qada_tail_fused_split_kernel" and k["flags"].get("HEADS_APART")
               and not k["flags"].get("SCORE") for k in kernels)
    assert any(k["kernel"] == "qada_decode_split_kernel" and k["flags"].get("POLICY") for k in kernels)
    assert "qada_tail_page_top_kernel" not in names  # (a step's page-top programs run in its moment launch)
    tops = [k for k in kernels if k["kernel"] == "current_moment_step_kernel" and k["flags"].get("PAGE_TOPS")]
    assert tops, "no moment step at the longer cache ran page-top programs"
    spread = [k for k in kernels if k["kernel"] == "qada_tail_fused_split_kernel" and k["flags"].get("CANDIDATES")]
    assert spread, "no step at the longer cache merged spread page bounds"
    assert any(k["flags"].get("ATTEND") for k in spread), "no split that attends merged spread page bounds"
    assert all(k["registers"] > 0 for k in kernels)


@pytest.mark.slow
def test_no_kernel_spills_or_crowds_out_its_neighbours(kernels):
    def least_programs(kernel: str, label: str) -> int:
        return ROW_HEAD_KERNELS.get(kernel, 2 if label.startswith("d=256") else MIN_PROGRAMS_PER_SM)

    bad = [(k["kernel"], k["flags"], k["configs"][0], k["registers"], k["spill_stores"], k["resident"])
           for k in kernels
           if k["spill_stores"] > MAX_SPILL_BYTES or k["resident"] < least_programs(k["kernel"], k["configs"][0][0])]
    assert not bad, f"kernels that spill or fit fewer programs per SM than {MIN_PROGRAMS_PER_SM} (2 at d=256): {bad}"
    assert any(k["flags"].get("SOFTCAP") for k in kernels), "no soft-capped kernel was compiled"


@pytest.mark.slow
def test_only_the_splits_that_hold_the_most_state_are_capped_and_compile_within_it(kernels):
    """The ``qada_tail`` split with ``attend_exact`` or a page hierarchy is launched with a register cap at head sizes
    up to 128 (168: three programs of four warps per SM; Triton 3.6 gave it 211-240 registers uncapped), none at 256
    and no other kernel: ``ptxas`` fills a cap it is given."""
    capped = [k for k in kernels if k.get("maxnreg") is not None]
    assert {k["kernel"] for k in capped} == {"qada_tail_fused_split_kernel"}
    assert all(k["maxnreg"] == 168 and k["registers"] <= 168 and not k["configs"][0][0].startswith("d=256")
               for k in capped)
    capped_configs = {config for k in capped for _, config in k["configs"]}
    assert capped_configs == {"qada_tail+E fused", "qada_tail+E/lean fused"}, capped_configs


@pytest.mark.slow
def test_the_attention_inside_the_fused_kernels_is_pipelined_as_the_plain_split(kernels):
    """A split that attends issues its next blocks' loads asynchronously (``cp.async``) while it computes, as the
    plain ``triton`` split does, and so do the splits that rank a budget's scores or apply the group policy to heads
    decided apart; before, the decision made in the fused kernels left their attention loop unpipelined (bounds
    derived from the window loop's result)."""
    plain = {k["configs"][0][0]: k["async_copies"] for k in kernels if k["kernel"] == "qada_decode_split_kernel"
             and not k["flags"].get("RANK") and not k["flags"].get("POLICY") and not k["flags"].get("ALL_DENSE")}
    attending = [k for k in kernels if k["kernel"].endswith("fused_split_kernel") and k["flags"].get("ATTEND")]
    ranking = [k for k in kernels if k["kernel"] == "qada_decode_split_kernel" and k["flags"].get("RANK")]
    policy = [k for k in kernels if k["kernel"] == "qada_decode_split_kernel" and k["flags"].get("POLICY")]
    attending += ranking + policy  # (the splits that rank a budget's scores or apply the group policy: their bounds
    # come from that decision)
    assert attending and ranking and policy and all(n > 0 for n in plain.values())
    for k in attending:
        label = k["configs"][0][0]
        assert k["async_copies"] >= plain[label], (k["kernel"], k["flags"], label, k["async_copies"], plain[label])


def test_programmatic_dependent_launches_wait_before_reading_the_previous_launch(kernels):
    """With the ``triton_fused`` executor's ``pdl``, a layer's launches are programmatic dependent launches: the
    moment step's and the splits' kernels let the next launch start (``griddepcontrol.launch_dependents``), the
    splits and the combine wait for the previous launch (``griddepcontrol.wait``) before reading what it wrote;
    without it the kernels have neither instruction (the budget's and a ``qada_tail`` decision merging page-top
    programs' lists never: they follow a launch that does not let them start early, or merge before they would
    wait)."""
    expected = {"current_moment_step_kernel": (True, False),  # (these shapes step current moments)
                "qada_fused_split_kernel": (True, True), "qada_tail_fused_split_kernel": (True, True),
                "qada_decode_combine_kernel": (False, True)}  # (the pdl rows decide in their splits)
    with_pdl = [k for k in kernels if k["flags"].get("PDL")]
    assert {k["kernel"] for k in with_pdl} == set(expected)
    for k in with_pdl:
        assert all(c[1].endswith(" pdl") for c in k["configs"]), k["configs"]
        assert (k["pdl_starts"] > 0, k["pdl_waits"] > 0) == expected[k["kernel"]], (k["kernel"], k["configs"])
    assert not any(k["pdl_starts"] or k["pdl_waits"] for k in kernels if not k["flags"].get("PDL"))
    assert not any(k["flags"].get("CANDIDATES") for k in with_pdl)


def test_programs_per_sm_follow_the_sm90_limits():
    sys.path.insert(0, str(ROOT))
    from benchmarks.kernel_resources import programs_per_sm

    assert programs_per_sm(255, 4, 0)["by_registers"] == 2  # 256 x 32 x 4 = 32768 registers per program
    assert programs_per_sm(128, 4, 0)["resident"] == 4
    assert programs_per_sm(72, 4, 20480)["resident"] == 7  # 72 -> 2304 per warp, 7 programs of 4 warps
    assert programs_per_sm(32, 4, 40960)["by_shared"] == 5  # 228 KiB / (40 KiB + 1 KiB)
    assert programs_per_sm(16, 1, 0)["resident"] == 32  # at most 32 programs
