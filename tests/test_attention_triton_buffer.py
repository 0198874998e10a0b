"""The ``triton`` executor on a preallocated buffer (rows ``[start, end)``): equality with the reference over
generated cases, the blocks it loads (virtual block lists), empty splits, no host sync, two launches, and a
GPU compile of both kernels (no GPU needed). On CPU the kernels run in Triton's interpreter: small shapes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

import qada.attention  # noqa: E402, F401  (registers every executor)
from qada.attention import EXECUTORS, decode_attention  # noqa: E402
from qada.attention.base import GroupDecision  # noqa: E402
from qada.step import DecodeStep  # noqa: E402
from qada.window import Window  # noqa: E402
from tests.test_attention_triton import DEVICE, WINDOW, check, hand_blocks, make_case  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rows(values):
    return None if values is None else torch.tensor(values, device=DEVICE)


@settings(max_examples=20, deadline=None)
@given(
    b=st.integers(1, 3),
    H_kv=st.integers(1, 3),
    G=st.sampled_from([1, 2, 4]),
    C=st.integers(1, 200),
    d=st.sampled_from([8, 16, 24]),
    t_local=st.integers(1, 48),
    t_sink_frac=st.floats(0, 1),
    block=st.sampled_from([16, 32]),
    splits=st.sampled_from([None, 1, 2, 3, 7]),
    mask=st.sampled_from(["local", "dense", "mixed", "mixed+one_group_local"]),
    policy=st.sampled_from(["exact", "promote"]),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_buffer_equals_reference_generated(b, H_kv, G, C, d, t_local, t_sink_frac, block, splits, mask, policy,
                                           dtype, data):  # fmt: skip
    """Odd buffer lengths, rows ending before the buffer's end, left padding, rows without a bulk, GQA 1/2/4."""
    window = Window(t_local, int(t_sink_frac * t_local))
    starts = data.draw(st.one_of(st.none(), st.lists(st.integers(0, C - 1), min_size=b, max_size=b)), "starts")
    firsts = starts or [0] * b
    ends = data.draw(st.one_of(st.none(), st.tuples(*(st.integers(f + 1, C) for f in firsts))), "ends")
    q, k, v, local, start = make_case(b, H_kv * G, H_kv, C, d, starts, mask, dtype, seed=C)
    executor = EXECUTORS.build("triton", group_policy=policy, block_size=block, num_splits=splits)
    check(executor, (q, k, v, local, start), window, end=rows(None if ends is None else list(ends)))


@pytest.mark.parametrize(("dtype", "G"), [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 1),
                                          (torch.bfloat16, 4)], ids=str)  # fmt: skip
def test_buffer_dtypes_and_group_sizes(dtype, G):
    """Rows ``[5, 190)``, ``[0, 120)`` and ``[170, 201)`` (no bulk) of a 201-slot buffer, one group all local."""
    case = make_case(3, 2 * G, 2, 201, 32, [5, 0, 170], "mixed+one_group_local", dtype, seed=G)
    check(EXECUTORS.build("triton", num_splits=3), case, WINDOW, end=rows([190, 120, 201]))


@pytest.mark.parametrize("mask", ["local", "dense", "mixed"])
def test_buffer_end_without_start(mask):
    case = make_case(2, 4, 2, 150, 16, None, mask, torch.float32, seed=3)
    check(EXECUTORS.build("triton", block_size=16, num_splits=4), case, WINDOW, end=rows([149, 64]))


def test_buffer_block_counts_by_hand():
    """C = 200, blocks of 16, window (32, 4). Row 0 ``[0, 180)``: bulk ``[4, 152)``; row 1 ``[10, 150)``: bulk
    ``[14, 122)``. Row 0 reads group 0 (blocks 0..11, bulk-only 1..8) and keeps group 1 local (blocks 0, 9, 10,
    11); row 1 keeps group 0 local (blocks 0, 7, 8, 9) and reads group 1 (blocks 0..9, bulk-only 1..6)."""
    q, k, v, _, _ = make_case(2, 4, 2, 200, 16, None, "dense", torch.float32, seed=11)
    local = torch.tensor([[False, True, True, True], [True, True, True, False]], device=DEVICE)
    start, end = rows([0, 10]), rows([180, 150])
    case = (q, k, v, local, start)
    for policy in ("exact", "promote"):
        got = check(EXECUTORS.build("triton", group_policy=policy, block_size=16, num_splits=3), case, end=end)
        assert got.bulk_blocks.item() == 8 + 6
    assert hand_blocks(200, 16, start, end, local.cpu(), 2, WINDOW) == (12 + 4 + 4 + 10, 8 + 6)
    executor = EXECUTORS.build("triton", block_size=16, num_splits=3)
    step = DecodeStep.from_attention(q, k, v, WINDOW, start=start, end=end)
    launch = executor.launch(step, GroupDecision(local, torch.tensor([[True, False], [False, True]])))
    assert launch.counts[..., 1].sum(dim=1).tolist() == [12, 4, 4, 10]  # loaded per (row, KV head)
    assert launch.counts[..., 0].sum(dim=1).tolist() == [8, 0, 0, 6]


def test_all_local_long_buffer_iterates_over_the_window_only():
    """2048 slots, blocks of 16, 8 splits: a local group loads its sink block and recent blocks (1 + 2 on row 0,
    1 + 3 on row 1), nothing else, so most of its splits are empty; a dense group loads every block."""
    C = 2048
    q, k, v, local, _ = make_case(2, 4, 2, C, 16, None, "local", torch.float32, seed=1)
    start, end = rows([0, 40]), rows([C, 1500])  # row 1: sinks [40, 44) in block 2, recent [1472, 1500) in 92..93
    executor = EXECUTORS.build("triton", block_size=16, num_splits=8)
    step = DecodeStep.from_attention(q, k, v, WINDOW, start=start, end=end)
    launch = executor.launch(step, GroupDecision(local, torch.zeros(2, 2, dtype=torch.bool, device=DEVICE)))
    ref = decode_attention(EXECUTORS.build("reference"), q, k, v, local, WINDOW, start=start, end=end)
    torch.testing.assert_close(launch.output, ref.output, atol=2e-5, rtol=2e-5)
    assert launch.counts[..., 1].sum(dim=1).tolist() == [3, 3, 3, 3] and launch.bulk_blocks.item() == 0
    assert launch.counts[..., 1].tolist()[0] == [1, 1, 1, 0, 0, 0, 0, 0]  # one block per split, then empty
    empty = launch.counts[..., 1] == 0
    assert (launch.m[empty] == float("-inf")).all() and (launch.l[empty] == 0).all() and (launch.acc[empty] == 0).all()
    dense = torch.zeros_like(local)
    launch = executor.launch(step, GroupDecision(dense, torch.ones(2, 2, dtype=torch.bool, device=DEVICE)))
    assert launch.counts[..., 1].sum(dim=1).tolist() == [128, 128, 92, 92]  # [40, 1500): blocks 2..93
    assert launch.bulk_blocks.item() == 2 * (128 - 1 - 2) + 2 * (92 - 1 - 2)


@pytest.mark.parametrize("mask", ["local", "dense"])
def test_more_splits_than_blocks(mask):
    """40 slots in 3 blocks over 8 splits: splits 3..7 are empty (m = -inf, l = 0) and weigh 0 in the merge."""
    q, k, v, local, start = make_case(1, 4, 2, 40, 16, None, mask, torch.float32, seed=4)
    executor = EXECUTORS.build("triton", block_size=16, num_splits=8)
    check(executor, (q, k, v, local, start), Window(16, 4))
    step = DecodeStep.from_attention(q, k, v, Window(16, 4))
    launch = executor.launch(step, GroupDecision(local, (~local).view(1, 2, 2).any(-1)))
    assert (launch.counts[..., 1][:, 3:] == 0).all() and (launch.m[:, 3:] == float("-inf")).all()
    assert (launch.l[:, 3:] == 0).all()


def test_padding_unfilled_slots_and_skipped_bulk_are_never_loaded():
    """NaN before ``start``, at and beyond ``end`` and on every bulk token of a local group (also those sharing a
    block with window tokens) never reaches the output."""
    q, k, v, local, start = make_case(2, 4, 2, 160, 16, [8, 0], "dense", torch.float32, seed=9)
    local[:, :2] = True  # KV head 0 local in both rows; KV head 1 dense
    end = rows([150, 100])
    executor = EXECUTORS.build("triton", block_size=16, num_splits=3)
    clean = decode_attention(EXECUTORS.build("reference"), q, k, v, local, WINDOW, start=start, end=end)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for r, (first, last) in enumerate([(8, 150), (0, 100)]):
        for x in (poisoned_k, poisoned_v):
            x[r, :, :first] = float("nan")
            x[r, :, last:] = float("nan")
            x[r, 0, first + WINDOW.t_sink : last - WINDOW.t_recent] = float("nan")  # the local group's bulk
    got = decode_attention(executor, q, poisoned_k, poisoned_v, local, WINDOW, start=start, end=end)
    assert torch.isfinite(got.output).all()
    torch.testing.assert_close(got.output, clean.output, atol=2e-5, rtol=2e-5)


def test_attend_never_syncs_and_launches_two_kernels(monkeypatch):
    """With ``start`` and ``end`` given: no item/tolist/nonzero/bool/int on a tensor during the call, and the
    executor's own work is two kernel launches plus allocations (every other aten op is recorded)."""
    from tests.triton_launches import LaunchRecorder, refusing_host_reads

    q, k, v, local, start = make_case(2, 8, 2, 150, 16, [0, 37], "mixed+one_group_local", torch.float32, seed=5)
    end = rows([150, 121])
    executor = EXECUTORS.build("triton", block_size=16, num_splits=3)
    ref = decode_attention(EXECUTORS.build("reference"), q, k, v, local, WINDOW, start=start, end=end)
    step = DecodeStep.from_attention(q, k, v, WINDOW, start=start, end=end)
    decision_step = DecodeStep.from_attention(q, k, v, WINDOW, start=start, end=end)
    record = LaunchRecorder(monkeypatch)
    launches = record.launches
    with refusing_host_reads(monkeypatch):
        got = executor(step, local)  # the whole call: group policy, sparsities, kernels
        decision = GroupDecision(got.local, (~got.local).view(2, 2, 4).any(-1))
        with record:
            output, bulk_blocks = executor.attend(decision_step, decision)
    assert [name for name, _ in launches] == ["qada_decode_split_kernel", "qada_decode_combine_kernel"] * 2
    assert launches[0][1] == (2 * 2, 3) and launches[1][1] == (2 * 8 + 1,)  # the grid: shapes only
    # (view: the 0-d bulk-block count is a view of a 1-element buffer, no kernel)
    assert set(record.ops) <= {"aten.empty.memory_format", "aten.view.default"}, record.ops
    torch.testing.assert_close(got.output, ref.output, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(output, got.output, atol=0, rtol=0)
    assert bulk_blocks.ndim == 0 and bulk_blocks.item() == got.bulk_blocks.item()


COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qada.attention import _triton_kernel as K

    def build(kernel, pointers, constants, scalars):
        names = kernel.arg_names
        signature = {n: pointers.get(n, "constexpr" if n in constants else scalars.get(n, "i32")) for n in names}
        source = ASTSource(kernel, signature, constexprs={(names.index(n),): c for n, c in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))

    for dtype, has_rows, features, dense in (("bf16", True, True, False), ("fp32", False, False, False),
                                             ("bf16", True, False, True)):
        ints = {"START": "*i64", "END": "*i64"} if has_rows else {"START": "*" + dtype, "END": "*" + dtype}
        build(K.qada_decode_split_kernel,
              dict(Q="*" + dtype, K="*" + dtype, V="*" + dtype, LOCAL="*i1", ACC="*fp32", M="*fp32", L="*fp32",
                   COUNTS="*i32", SCORE="*" + dtype, COUNT="*" + dtype, DECIDED="*" + dtype, BROKEN="*" + dtype,
                   READ="*" + dtype, **ints),  # (the budget's inputs: not read without RANK)
              dict(G=4, D=128, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, HAS_START=has_rows, HAS_END=has_rows,
                   INPUT_PRECISION="ieee" if dtype == "fp32" else None, DOT_FP32=False, SOFTCAP=features,
                   PDL=features, ALL_DENSE=dense, RANK=False, BLOCK_H=32, BLOCK_KV=16, PER_GROUP=False,
                   PROMOTE=False, POLICY=False),
              {"qk_scale": "fp64", "softcap": "fp64"})  # what Inductor may pass for a Python float
        build(K.qada_decode_combine_kernel,  # with features: the statistics row and E's split (the fused step's)
              dict(ACC="*fp32", M="*fp32", L="*fp32", COUNTS="*i32", OUT="*" + dtype, BULK_BLOCKS="*i64",
                   SINKS="*" + dtype, LOCAL="*u8", READ="*u8", BROKEN="*u8", ROW="*fp64", SUMS="*fp64",
                   LAYER="*i64", EXTRA_M="*fp32", EXTRA_L="*fp32", EXTRA_ACC="*fp32", EXTRA_LOCAL="*u8", **ints),
              dict(G=4, D=128, BLOCK_S=64, CHUNK_S=16, BLOCK_D=128, BLOCK_C=256, HAS_SINKS=features,
                   STATS=features or dense, HAS_START=has_rows, HAS_END=has_rows, TAIL_READS=features,
                   ADD=features or dense, EXTRA=features, PDL=features, ALL_DENSE=dense), {})
    print("compiled")
    """
)


def test_kernels_compile_for_the_gpu_with_a_float64_scale():
    """Both kernels compile (TTIR .. cubin) for sm_90 without a GPU, the scale arriving as fp64 (the earlier
    Inductor failure: ``m_i`` initialised fp32, redefined fp64 in the loop), with and without a soft cap and sink
    logits, and for the ``dense`` criterion's step (``ALL_DENSE``)."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
