"""The moments one decode step ahead: with ``triton_fused(estimate_in_splits=True)`` on the built-in ``current`` and
``stored`` sources, each step's combine launch also steps the moments for the next step
(:mod:`qada.attention._ahead_kernel`), so a layer's step is two launches. The same state, bit for bit, as the moment
step's own launch made one step later. On CPU the kernels run in Triton's interpreter (small shapes only)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from qada.attention import FusedTritonExecutor  # noqa: E402
from qada.attention.moment_step import current_step_rider  # noqa: E402
from qada.attention.triton_decode import combine  # noqa: E402
from qada.criteria import QAdACriterion  # noqa: E402
from qada.models.fused_step import fused_moment_step, moment_step_rider, steps_moments_ahead  # noqa: E402
from qada.moments import CurrentMoments  # noqa: E402
from tests.test_attention_triton import DEVICE  # noqa: E402
from tests.test_moment_step_kernel import STARTS, WINDOW, grid_order, prefilled  # noqa: E402


def split_outputs(b=2, H=4, H_kv=2, S=3, d=16, seed=0):
    """Random split partials ``(query [b, H, d], acc, m, l, counts)`` for a combine launch."""
    g = torch.Generator().manual_seed(seed)
    pairs, G = b * H_kv, H // H_kv
    query = torch.randn(b, H, d, generator=g).to(DEVICE)
    acc = torch.randn(pairs, S, G, d, generator=g).to(DEVICE)
    m = torch.randn(pairs, S, G, generator=g).to(DEVICE)
    l = torch.rand(pairs, S, G, generator=g).to(DEVICE) + 0.5
    counts = torch.randint(0, 5, (pairs, S, 2), generator=g, dtype=torch.int32).to(DEVICE)
    return query, acc, m, l, counts


@pytest.mark.parametrize("kind", ["current", "stored"])
@pytest.mark.parametrize("d", [16, 40])
def test_the_combine_launch_steps_the_moments_as_the_moment_launch(kind, d):
    """After each of 12 steps, the state the combine launch steps for rows one key longer equals, bit for bit, the
    moment step's own launch for those rows (the row starting at 5 reaches the stored source's jump), the count of
    arrived programs is back at 0, and the combine's output is the plain combine's. d = 40: an off-diagonal block
    pair partly masked."""
    moments, keys, expected, ahead = prefilled(kind, d)
    start = STARTS.to(DEVICE)
    query, acc, m, l, counts = split_outputs(d=d)
    plain = combine(query, acc, m, l, counts, None)
    for end in range(15, 27):
        ends = torch.full((2,), end, device=DEVICE)
        fused_moment_step(moments, expected, keys, start, ends + 1, WINDOW)
        rider = moment_step_rider(moments, ahead, keys, start, ends, WINDOW)
        got = combine(query, acc, m, l, counts, None, rider=rider)
        for name in expected:
            assert torch.equal(ahead[name], expected[name]), f"{name} at {end}"
        assert not ahead["arrived"].any()
        torch.testing.assert_close(got[0], plain[0], atol=0, rtol=0)
        assert torch.equal(got[1], plain[1])
    assert rider.programs == (3 if d == 40 else 1) and rider.pairs == 4


def test_a_count_not_at_zero_goes_wrong():
    """Not vacuous: with the arrival count off by one, the first block pair to finish believes itself the last and
    moves the count and the mean before the others read them: the state differs from the moment launch's (in grid
    order: interleaved, the others may have read them before)."""
    moments, keys, expected, ahead = prefilled("current", 40)
    start = STARTS.to(DEVICE)
    query, acc, m, l, counts = split_outputs(d=40)
    ends = torch.full((2,), 16, device=DEVICE)
    fused_moment_step(moments, expected, keys, start, ends + 1, WINDOW)
    ahead["arrived"] += 2
    with grid_order():
        combine(query, acc, m, l, counts, None, rider=moment_step_rider(moments, ahead, keys, start, ends, WINDOW))
    assert not all(torch.equal(ahead[name], expected[name]) for name in ("m2", "out_cov"))


def test_a_rider_needs_the_next_key_in_the_cache_and_the_estimate_in_the_splits():
    """``T_recent = 0`` would read the next step's own key, not yet written: refused. A rider given to splits that
    read the estimate (``estimate_in_splits`` off) is refused: their moments would be a step behind."""
    moments, keys, _, ahead = prefilled("current", 16)
    ends = torch.full((2,), 16, device=DEVICE)
    with pytest.raises(ValueError, match="T_recent >= 1"):
        current_step_rider(ahead, keys, None, ends, 8, 0)
    from tests.test_fused_decision import fresh, make_step

    step = make_step(2, 4, 2, 40, 16, None, None, torch.float32, seed=3)
    rider = moment_step_rider(moments, ahead, keys, None, ends, WINDOW)
    with pytest.raises(ValueError, match="estimate_in_splits=True"):
        FusedTritonExecutor(block_size=16, num_splits=2).decide_and_attend(fresh(step), 0.5, moment_rider=rider)


def test_which_runs_step_their_moments_ahead():
    """Only the plain ``qada`` decision estimating in the splits on a source with a step kernel: not a frozen source
    or one stepping in blocks (stepped in torch, no launch to save), not ``decide_once``, not another criterion."""
    executor = FusedTritonExecutor(estimate_in_splits=True)
    qada = QAdACriterion(0.5)

    def state_of(source):
        keys = torch.randn(2, 2, 20, 16)
        source.prefill(0, keys, None, WINDOW, capacity=20)
        return source.step_state(0)

    current = CurrentMoments()
    assert steps_moments_ahead(qada, current, executor, state_of(current))
    assert not steps_moments_ahead(qada, current, FusedTritonExecutor(), state_of(current))
    assert not steps_moments_ahead(qada, current, FusedTritonExecutor(estimate_in_splits=True, decide_once=True),
                                   state_of(current))
    for other in (CurrentMoments(freeze=True), CurrentMoments(update_every=2)):
        assert not steps_moments_ahead(qada, other, executor, state_of(other))
    from qada.criteria import BudgetedQAdACriterion

    assert not steps_moments_ahead(BudgetedQAdACriterion(sparsity=0.5), current, executor, state_of(current))
    assert not steps_moments_ahead(qada, current, "triton", state_of(current))


def test_ahead_kernels_compile_for_the_gpu():
    """Both combine launches that step the moments lower to PTX for sm_90 (no GPU needed), with programmatic
    dependent launches and the statistics row."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from qada.attention import _ahead_kernel as A
        pointers = {"ACC": "*fp32", "M": "*fp32", "L": "*fp32", "COUNTS": "*i32", "OUT": "*bf16",
                    "BULK_BLOCKS": "*i64", "SINKS": "*fp32", "LOCAL": "*u8", "READ": "*u8", "BROKEN": "*u8",
                    "START": "*i64", "END": "*i64", "ROW": "*fp64", "SUMS": "*fp64", "LAYER": "*i64",
                    "EXTRA_M": "*fp32", "EXTRA_L": "*fp32", "EXTRA_ACC": "*fp32", "EXTRA_LOCAL": "*u8",
                    "MS_COUNT": "*fp64", "MS_MEAN": "*fp64", "MS_M2": "*fp64", "MS_OUT_MEAN": "*fp32",
                    "MS_OUT_COV": "*fp32", "MS_KEYS": "*bf16", "MS_START": "*i64", "MS_END": "*i64",
                    "MS_ARRIVED": "*i32", "MS_S1": "*fp64", "MS_S2": "*fp64", "MS_OLD_END": "*i64",
                    "MS_JUMP_N": "*i64", "MS_JUMP_COUNT": "*fp64", "MS_JUMP_S1": "*fp64", "MS_JUMP_S2": "*fp64",
                    "MS_COV": "*fp32", "MS_REF": "*fp32", "MS_SHIFT": "*fp64"}
        constants = {"G": 4, "D": 128, "BLOCK_S": 16, "CHUNK_S": 16, "BLOCK_D": 128, "BLOCK_C": 256,
                     "HAS_SINKS": True, "STATS": True, "HAS_START": True, "HAS_END": True, "TAIL_READS": False,
                     "ADD": True, "EXTRA": False, "PDL": True, "ALL_DENSE": False, "MS_D": 128, "MS_BLOCK_T": 32,
                     "MS_BLOCK_D": 128, "MS_HAS_START": True}
        for kernel in (A.combine_and_current_step_kernel, A.combine_and_stored_step_kernel):
            names = kernel.arg_names
            kinds = dict(pointers, MS_MEAN="*fp64" if "MS_M2" in names else "*fp32")
            signature = {n: kinds.get(n, "constexpr" if n in constants else "i32") for n in names}
            source = ASTSource(kernel, signature, constexprs={(names.index(n),): c for n, c in constants.items()})
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            assert "ptx" in compiled.asm
        print("ok")
    """)
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
