"""The fused ``triton`` decode kernel against the reference; on CPU it runs in Triton's interpreter (slow:
small shapes only)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

import qada.attention  # noqa: E402, F401  (registers every executor)
from qada.attention import EXECUTORS, check_triton_runtime, decode_attention  # noqa: E402
from qada.attention.base import GroupDecision  # noqa: E402
from qada.step import DecodeStep  # noqa: E402
from qada.window import Window  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WINDOW = Window(32, 4)
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def make_case(b, H, H_kv, T, d, starts, mask, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, 1, d, generator=g)
    k = torch.randn(b, H_kv, T, d, generator=g) * 1.5
    v = torch.randn(b, H_kv, T, d, generator=g)
    local = {
        "local": torch.ones(b, H, dtype=torch.bool),
        "dense": torch.zeros(b, H, dtype=torch.bool),
        "mixed": torch.rand(b, H, generator=g) < 0.5,
    }[mask.removesuffix("+one_group_local")]
    if mask.endswith("+one_group_local"):  # KV head 0 fully local (bulk skipped), the last one read
        local.view(b, H_kv, H // H_kv)[:, 0] = True
        local.view(b, H_kv, H // H_kv)[:, -1, 0] = False
    start = None if starts is None else torch.tensor(starts, device=DEVICE)
    return (*(t.to(DEVICE, dtype) for t in (q, k, v)), local.to(DEVICE), start)


def hand_blocks(C, block, starts, ends, local, H_kv, window):
    """``(loaded, bulk_only)`` block counts summed over the (row, KV head) pairs, from token sets: a pair loads the
    blocks meeting its real tokens when some head of its group is dense (``local`` is the effective mask), else
    those meeting its window; bulk-only blocks are loaded blocks without a window token."""
    b, H = local.shape
    G = H // H_kv
    loaded = bulk_only = 0
    for r in range(b):
        first = 0 if starts is None else int(starts[r])
        last = C if ends is None else int(ends[r])
        real = set(range(first, last))
        t_bulk = max(0, last - first - window.t_local)
        window_tokens = real - set(range(first + window.t_sink, first + window.t_sink + t_bulk))
        for g in range(H_kv):
            read = not bool(local[r, g * G : (g + 1) * G].all())
            blocks = {p // block for p in (real if read else window_tokens)}
            loaded += len(blocks)
            bulk_only += sum(not (set(range(x * block, x * block + block)) & window_tokens) for x in blocks)
    return loaded, bulk_only


def check(executor, case, window=WINDOW, end=None):
    """The executor against the reference on ``case`` (rows ending at ``end [b]`` when given), with its
    ``bulk_blocks`` and (from a second launch) its per-program loaded block counts against :func:`hand_blocks`."""
    q, k, v, local, start = case
    reference = EXECUTORS.build("reference", group_policy=executor.group_policy)
    ref = decode_attention(reference, q, k, v, local, window, start=start, end=end)
    got = decode_attention(executor, q, k, v, local, window, start=start, end=end)
    assert got.output.shape == q.shape and got.output.dtype == q.dtype
    assert torch.isfinite(got.output).all()
    atol, rtol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got.output.float(), ref.output.float(), atol=atol, rtol=rtol)
    assert torch.equal(got.local, ref.local)
    torch.testing.assert_close(got.sparsity, ref.sparsity)
    torch.testing.assert_close(got.kv_sparsity, ref.kv_sparsity)
    loaded, bulk_only = hand_blocks(k.shape[2], executor.block_size, start, end, got.local.cpu(), k.shape[1], window)
    assert got.bulk_blocks.ndim == 0 and got.bulk_blocks.item() == bulk_only
    step = DecodeStep.from_attention(q, k, v, window, start=start, end=end)
    read = (~got.local).view(q.shape[0], k.shape[1], -1).any(dim=-1)
    launch = executor.launch(step, GroupDecision(got.local, read))
    assert launch.counts[..., 1].sum().item() == loaded and launch.counts[..., 0].sum().item() == bulk_only
    torch.testing.assert_close(launch.output, got.output, atol=0, rtol=0)
    return got


CASES = [  # (b, H, H_kv, T, d, starts, mask, num_splits)
    (1, 2, 2, 20, 16, None, "mixed", 1),  # T < T_local: no bulk, a single partial block
    (1, 4, 2, 33, 16, None, "dense", 2),  # one bulk token; split 1 of 2 is empty (one block)
    (2, 4, 1, 150, 32, [0, 37], "mixed+one_group_local", 3),
    (3, 8, 2, 300, 16, [0, 100, 280], "mixed+one_group_local", 5),  # row 2: 20 real tokens, no bulk
    (2, 4, 4, 97, 32, [5, 0], "local", 1),
    (2, 8, 2, 257, 16, [0, 3], "mixed+one_group_local", 16),  # more splits than blocks: empty splits
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(str(x) for x in c[:5]) + f"-{c[6]}-s{c[7]}")
@pytest.mark.parametrize("policy", ["exact", "promote"])
def test_triton_equals_reference_float32(case, policy):
    b, H, H_kv, T, d, starts, mask, splits = case
    executor = EXECUTORS.build("triton", group_policy=policy, num_splits=splits)
    check(executor, make_case(b, H, H_kv, T, d, starts, mask, torch.float32, seed=T))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_equals_reference_half(dtype):
    case = make_case(2, 8, 2, 200, 32, [0, 60], "mixed+one_group_local", dtype, seed=2)
    check(EXECUTORS.build("triton", num_splits=3), case)


def test_triton_odd_window_and_block():
    """No sinks, a window that is not a block multiple, block 16, auto splits."""
    case = make_case(2, 4, 2, 90, 16, [0, 11], "mixed", torch.float32, seed=5)
    check(EXECUTORS.build("triton", block_size=16), case, Window(21, 0))


def test_triton_skips_the_bulk_of_local_groups():
    """NaN in a skipped group's pure-bulk blocks never reaches the output; read groups do read their bulk."""
    q, k, v, local, start = make_case(1, 4, 2, 256, 16, None, "dense", torch.float32)
    local[:, :2] = True  # KV head 0 is all local: its blocks 1 and 2 (tokens 64..191) hold only bulk tokens
    poisoned = k.clone()
    poisoned[:, 0, 64:192] = float("nan")
    res = decode_attention(EXECUTORS.build("triton", num_splits=2), q, poisoned, v, local, WINDOW, start=start)
    ref = decode_attention(EXECUTORS.build("reference"), q, k, v, local, WINDOW, start=start)
    torch.testing.assert_close(res.output, ref.output, atol=2e-5, rtol=2e-5)
    assert res.bulk_blocks.item() == 2 and res.kv_sparsity.item() == 0.5
    poisoned = k.clone()
    poisoned[:, 1, 64:192] = float("nan")
    res = decode_attention(EXECUTORS.build("triton", num_splits=2), q, poisoned, v, local, WINDOW, start=start)
    assert res.output[0, 2:].isnan().all() and not res.output[0, :2].isnan().any()


def test_triton_without_gpu_or_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA device, or Triton's interpreter"):
        check_triton_runtime(torch.device("cpu"))
    case = make_case(1, 2, 1, 40, 16, None, "mixed", torch.float32)
    cpu_case = [t.cpu() for t in case[:4]]
    with pytest.raises(RuntimeError, match="choose another executor"):
        decode_attention(EXECUTORS.build("triton"), *cpu_case, WINDOW)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_triton_runtime(torch.device("cpu"))  # the interpreter makes CPU tensors acceptable


def test_triton_older_than_the_kernels_need_is_an_error(monkeypatch):
    """Triton before 3.3 (its compiler not checked with qada's kernels) is refused with the version found, before
    any launch; the installed one passes; versions parse as ``(major, minor)``."""
    from qada.attention import triton_decode

    assert triton_decode.triton_version() >= triton_decode.MIN_TRITON
    assert triton_decode.version_of("3.2.0") == (3, 2) and triton_decode.version_of("3.4.0+git1234abcd") == (3, 4)
    assert triton_decode.version_of("4") == (4, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_decode, "triton_version", lambda: (3, 2))
    with pytest.raises(ImportError, match=r"needs Triton 3\.3 or later .* found 3\.2"):
        check_triton_runtime(torch.device("cpu"), executor="triton_fused")
    monkeypatch.setattr(triton_decode, "triton_version", lambda: (3, 4))
    check_triton_runtime(torch.device("cpu"))


def test_triton_rejects_float64_and_bad_parameters():
    case = make_case(1, 2, 1, 40, 16, None, "mixed", torch.float64)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        decode_attention(EXECUTORS.build("triton"), *case[:4], WINDOW)
    with pytest.raises(ValueError, match="expected block_size to be a power of two"):
        EXECUTORS.build("triton", block_size=48)
    with pytest.raises(ValueError, match="expected num_splits to be a positive int"):
        EXECUTORS.build("triton", num_splits=0)
    with pytest.raises(ValueError, match="expected programs_per_sm to be a positive int but got 0"):
        EXECUTORS.build("triton_fused", programs_per_sm=0)


def test_split_count_aims_at_programs_per_sm_and_keeps_four_blocks_per_split(monkeypatch):
    from qada.attention import triton_decode

    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)  # an H200's SMs
    cpu = torch.device("cpu")
    # SmolLM2 at 7,680 tokens: 120 blocks of 64; 32 rows x 3 KV heads = 96 (row, KV head) pairs
    assert EXECUTORS.build("triton").splits(cpu, 96, 7680) == 3  # ceil(2 * 132 / 96)
    assert EXECUTORS.build("triton", programs_per_sm=8).splits(cpu, 96, 7680) == 11  # ceil(8 * 132 / 96)
    assert EXECUTORS.build("triton_fused", programs_per_sm=8).splits(cpu, 96, 7680) == 11
    # one row: at most one split per four blocks, whatever programs_per_sm asks
    assert EXECUTORS.build("triton").splits(cpu, 3, 7680) == 30
    assert EXECUTORS.build("triton", programs_per_sm=8).splits(cpu, 3, 7680) == 30
    assert EXECUTORS.build("triton", programs_per_sm=8, num_splits=5).splits(cpu, 96, 7680) == 5  # given: kept


def test_register_cap_leaves_room_for_the_programs_asked():
    from qada.attention.triton_decode import register_cap

    assert register_cap(4, 3) == {"maxnreg": 168}  # 65,536 / (3 x 128 threads), a warp's share in units of 256
    assert register_cap(4, 2) == {"maxnreg": 255}  # (256 would fit: a thread addresses 255 at most)
    assert register_cap(8, 3) == {"maxnreg": 80}
    assert register_cap(4, 4) == {"maxnreg": 128}
    for bad in ((0, 3), (4, 0), (True, 3), (32, 3)):  # (32 warps, 3 programs: 16 registers a thread)
        with pytest.raises(ValueError, match="expected"):
            register_cap(*bad)


@given(warps=st.sampled_from([1, 2, 4, 8, 16]), programs=st.integers(1, 16))
def test_register_cap_is_the_largest_that_fits(warps, programs):
    """The cap's programs fit one SM's register file, warp by warp in units of 256 registers, and one more register
    in every warp's share (the next unit) would not, unless the thread limit (255) or the floor stop it first."""
    from qada.attention.triton_decode import SM_REGISTERS, register_cap

    per_warp = SM_REGISTERS // (warps * programs) // 256 * 256
    if per_warp < 32 * 32:
        with pytest.raises(ValueError, match="at least 32 registers"):
            register_cap(warps, programs)
        return
    cap = register_cap(warps, programs)["maxnreg"]
    units = -(-cap * 32 // 256)  # a warp's registers, in units of 256
    assert units * 256 * warps * programs <= SM_REGISTERS
    assert cap == 255 or (units + 1) * 256 * warps * programs > SM_REGISTERS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_gpu_long_context(dtype):
    case = make_case(2, 32, 8, 8191, 128, [0, 1000], "mixed+one_group_local", dtype, seed=7)
    check(EXECUTORS.build("triton"), case, Window(128, 16))
