"""``benchmarks/launch_bytes.py``: the bytes each Triton launch reads and writes, counted in Triton's interpreter,
and what it found: the stored moment step reads the prepared jump sums only at a jump, and the fused ``qada_tail``
bounds its pages from the extrema in a 16-bit cache's dtype, not from the float32 halves."""

from __future__ import annotations

import collections
import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402

from benchmarks.launch_bytes import ArgumentSpans, ByteRecorder, summarise, totals  # noqa: E402
from qada.attention import _triton_kernel  # noqa: E402
from tests.test_fused_decision import make_run, model, reference  # noqa: E402, F401 - the tiny model's fixtures

OWN_PROGRAM_ORDER = True
"""The byte recorder follows the interpreter's own program loop (``pytest --program-order`` leaves these tests
alone: tests/conftest.py)."""

pytestmark = pytest.mark.skipif(not _triton_kernel.INTERPRETED, reason="counts bytes in Triton's interpreter")


@triton.jit
def _gather_twice(X, IDX, OUT, n, BLOCK: tl.constexpr):
    """``OUT[i] = X[IDX[i]] + X[IDX[i]]`` for ``i < n``, loading ``X`` twice."""
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    idx = tl.load(IDX + offs, mask=ok, other=0)
    a = tl.load(X + idx, mask=ok, other=0.0)
    b = tl.load(X + idx, mask=ok, other=0.0)
    tl.store(OUT + offs, a + b, mask=ok)


def test_recorder_counts_each_masked_lane_and_each_distinct_byte():
    x = torch.arange(10, dtype=torch.float64)
    idx = torch.tensor([3, 3, 7, 1, 9, 0, 0, 0], dtype=torch.int32)  # 5 lanes on: 4 distinct elements of x
    out = torch.zeros(8, dtype=torch.float64)
    with ByteRecorder().recording() as recorder:
        _triton_kernel.run(_gather_twice, (1,), x, idx, out, 5, BLOCK=8)
    torch.testing.assert_close(out[:5], 2 * x[[3, 3, 7, 1, 9]])
    [launch] = recorder.launches
    assert launch["kernel"] == "_gather_twice"
    kernels = summarise(recorder.launches)
    entry = kernels["_gather_twice"]
    assert entry["read"]["X"] == {"unique": 4 * 8, "accessed": 2 * 5 * 8}
    assert entry["read"]["IDX"] == {"unique": 5 * 4, "accessed": 5 * 4}
    assert entry["written"] == {"OUT": {"unique": 5 * 8, "accessed": 5 * 8}}
    assert totals(kernels) == {"read_unique": 52, "read_accessed": 100, "other_read_unique": 52,
                               "written_unique": 40, "written_accessed": 40, "serial": 140, "serial_loads": 3}
    assert (entry["programs"], entry["heaviest"], entry["serial"]) == (1, 140, 140)  # one program moved everything
    assert entry["loads"] == entry["serial_loads"] == 3  # IDX, then X twice


@triton.jit
def _rows_of_their_length(X, LENGTHS, OUT, BLOCK: tl.constexpr):
    """Program ``r`` sums the first ``LENGTHS[r]`` elements of row ``r`` of ``X [n, BLOCK]`` into ``OUT[r]``."""
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    n = tl.load(LENGTHS + r)
    x = tl.load(X + r * BLOCK + offs, mask=offs < n, other=0.0)
    tl.store(OUT + r, tl.sum(x, axis=0))


def test_recorder_counts_each_programs_bytes_and_the_busiest_of_each_launch():
    """A launch lasts at least as long as its busiest program: ``heaviest`` is the most bytes one program moves (its
    loads and stores, re-reads included), ``serial`` that program's bytes summed over the launches."""
    x = torch.ones(3, 16, dtype=torch.float32)
    lengths = torch.tensor([2, 16, 5], dtype=torch.int64)
    out = torch.zeros(3)
    with ByteRecorder().recording() as recorder:
        _triton_kernel.run(_rows_of_their_length, (3,), x, lengths, out, BLOCK=16)
        _triton_kernel.run(_rows_of_their_length, (2,), x, lengths, out, BLOCK=16)  # rows 0 and 1 only
    torch.testing.assert_close(out, torch.tensor([2.0, 16.0, 5.0]))
    first, second = recorder.launches
    assert first["grid"] == 3 and second["grid"] == 2
    assert dict(first["programs"]["read"]) == {(0, 0, 0): 8 + 2 * 4, (1, 0, 0): 8 + 16 * 4, (2, 0, 0): 8 + 5 * 4}
    assert dict(first["programs"]["written"]) == {(p, 0, 0): 4 for p in range(3)}
    entry = summarise(recorder.launches)["_rows_of_their_length"]
    busiest = 8 + 16 * 4 + 4  # row 1's: its length, its 16 elements, its sum
    assert (entry["programs"], entry["heaviest"], entry["serial"]) == (3, busiest, 2 * busiest)
    assert entry["read"]["X"]["accessed"] == (2 + 16 + 5 + 2 + 16) * 4
    assert dict(first["programs"]["loads"]) == {(p, 0, 0): 2 for p in range(3)}  # its length, then its row
    assert (entry["loads"], entry["serial_loads"]) == (2, 4)


@triton.jit
def _walk(X, STEPS, OUT):
    """Program ``r`` loads ``X`` ``STEPS[r]`` times in a loop, each address the value the last load gave."""
    r = tl.program_id(0)
    steps = tl.load(STEPS + r)
    at = tl.zeros([], dtype=tl.int64)
    for _ in range(steps):
        at = tl.load(X + at)
    tl.store(OUT + r, at)


def test_recorder_counts_the_loads_of_each_programs_loop():
    """Each loop iteration's load is counted: the longest program of a launch is the one whose chain is longest."""
    x = torch.tensor([1, 2, 3, 0], dtype=torch.int64)  # 0 -> 1 -> 2 -> 3 -> 0
    steps = torch.tensor([1, 6, 2], dtype=torch.int64)
    out = torch.zeros(3, dtype=torch.int64)
    with ByteRecorder().recording() as recorder:
        _triton_kernel.run(_walk, (3,), x, steps, out)
    assert out.tolist() == [1, 2, 2]
    [launch] = recorder.launches
    assert dict(launch["programs"]["loads"]) == {(0, 0, 0): 2, (1, 0, 0): 7, (2, 0, 0): 3}
    entry = summarise(recorder.launches)["_walk"]
    assert (entry["loads"], entry["serial_loads"]) == (7, 7)
    assert totals({"_walk": entry})["serial_loads"] == 7


def test_recorder_is_off_outside_and_when_told():
    x, idx, out = torch.ones(4), torch.zeros(4, dtype=torch.int32), torch.zeros(4)
    recorder = ByteRecorder()
    _triton_kernel.run(_gather_twice, (1,), x, idx, out, 4, BLOCK=4)  # not recording
    with recorder.recording():
        recorder.on = False
        _triton_kernel.run(_gather_twice, (1,), x, idx, out, 4, BLOCK=4)
    assert recorder.launches == []
    assert _triton_kernel.run.__name__ != "launch"  # the launcher is restored


def test_spans_attribute_addresses_to_views_and_strided_tensors():
    import numpy as np

    base = torch.zeros(4, 6, dtype=torch.float32)
    column = base[:, 2]  # strided: elements 2, 8, 14, 20
    other = torch.zeros(3, dtype=torch.float64)
    spans = ArgumentSpans(["COLUMN", "OTHER"], [column, other])
    inside = np.array([column.data_ptr() + 4 * 6 * 3, other.data_ptr() + 16], dtype=np.uint64)
    outside = np.array([column.data_ptr() + 4 * 19], dtype=np.uint64)  # past the column's last element (20)
    groups = spans.split(np.concatenate([inside, outside]))
    assert groups["COLUMN"].tolist() == [inside[0]]
    assert groups["OTHER"].tolist() == [inside[1]]
    assert groups["?"].tolist() == [outside[0]]  # one past the column's extent: no argument's


def test_stored_moment_step_reads_the_jump_sums_only_at_a_jump():
    """The stored source's prepared sums (``JUMP_S2``: one ``[d, d]`` float64 matrix per row and KV head, as large as
    the state) are read by a (row, KV head) only at the step where its range jumps; before, every step read them."""
    from qada.models.fused_step import fused_moment_step
    from tests.test_moment_step_kernel import STARTS, WINDOW, prefilled

    d = 16
    moments, keys, _, state = prefilled("stored", d)
    jump_lengths = state["jump_n"]  # [b, K]: the row lengths at which a row's range jumps (-1: none)
    start = STARTS.to(keys.device)
    hits = 0
    for end in range(16, 28):
        rows_jumping = int(((jump_lengths == (end - start)[:, None]).any(dim=1)).sum())
        with ByteRecorder().recording() as recorder:
            fused_moment_step(moments, state, keys, start, torch.full((2,), end, device=keys.device), WINDOW)
        [launch] = summarise(recorder.launches).values()
        read = launch["read"].get("JUMP_S2", {"unique": 0})["unique"]
        assert read == rows_jumping * 2 * d * d * 8, f"end {end}"
        hits += rows_jumping
    assert hits == 2  # both rows jumped once in these steps



def test_count_step_on_a_model_reads_every_kv_byte_once_dense_and_less_when_sparse(model, reference):  # noqa: F811
    """:func:`count_step` on the tiny model: qada's all-dense Triton path reads the K/V of every real token of every
    layer exactly once (the dense step's K/V bytes); the fused QAdA step reads fewer K/V bytes where it skips bulks,
    and the moment step's float64 state is in its count, read and written."""
    from benchmarks.end_to_end import kv_bytes_per_token
    from benchmarks.launch_bytes import count_step
    from qada.models import build_run

    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(5)).to(model.device)
    dense_run = build_run(criterion="dense", moments="none", executor={"name": "triton", "block_size": 16})
    dense = count_step(model, dense_run, ids)
    kv = dense["totals"]["kv_unique"]
    assert kv == (ids.shape[1] + 2) * kv_bytes_per_token(model)  # the prompt, the first token and the step's
    assert dense["kernels"]["qada_decode_split_kernel"]["read"]["K"]["accessed"] == kv // 2
    fused = count_step(model, make_run("stored", {"name": "triton_fused", "block_size": 16}, reference,
                                       criterion={"name": "qada", "tau": 0.05}), ids)  # fmt: skip
    assert fused["kv_sparsity"] > 0
    assert 0 < fused["totals"]["kv_unique"] < kv
    moment = fused["kernels"]["stored_moment_step_kernel"]
    assert moment["read"]["S2"]["unique"] == moment["written"]["S2"]["unique"] > 0
    # the moment step writes each head's log E[exp(s)] ([b, H] float32 per layer), the split reads it, not the
    # [d, d] covariance (each split read that once before)
    config = model.config
    estimates = config.num_hidden_layers * config.num_attention_heads * 4
    split = fused["kernels"]["qada_fused_split_kernel"]["read"]
    assert not {"MEAN", "COV"} & {part for name in split for part in name.split("=")}
    assert argument(split, "LME")["unique"] == argument(moment["written"], "LME")["unique"] == estimates


def argument(counts: dict, name: str) -> dict:
    """The counts of argument ``name`` (maybe passed as others too: ``"LME=GH_X"``)."""
    [found] = [value for key, value in counts.items() if name in key.split("=")]
    return found


@pytest.mark.parametrize("decide_once,pages_per_program", [(False, 256), (True, 5)], ids=["split", "page_top"])
def test_fused_tail_bounds_pages_from_extrema_in_the_cache_dtype(decide_once, pages_per_program):
    """In a bfloat16 cache the page extrema are bfloat16 (exact: each is one of the keys) and the fused ``qada_tail``
    step bounds every page from them: 2 x d x 2 bytes a page, where the float32 halves it read before are
    2 x d x 4; of the halves it writes only the step key's page and reads none. The decisions and the state stay
    the eager criterion's (:func:`tests.test_fused_tail.check_tail`)."""
    from tests.test_fused_tail import CASES, check_tail, make_step, prepared, tail_tau

    b, H, H_kv, C, d, starts, ends, dtype, softcap, sinks, policy, block, splits, sizes = CASES[2]
    assert dtype == torch.bfloat16  # (45 pages of 8: with 5 pages per program, 9 page-top programs per pair)
    step = make_step(b, H, H_kv, C, d, starts, ends, dtype, seed=C, softcap=softcap, sinks=sinks)
    criterion, state = prepared(step, C, **sizes)
    assert state["kmin"].dtype == state["kmax"].dtype == torch.bfloat16 and state["halves"].dtype == torch.float32
    tau = tail_tau(criterion, step, state, H // H_kv, policy)
    with ByteRecorder().recording() as recorder:
        check_tail(criterion, step, state, tau, policy, block, splits, decide_once, pages_per_program)
    kernels = summarise(recorder.launches)
    reads = collections.Counter()  # by argument name (a tensor passed twice is "KMIN=SUPER_KMIN": one level passes
    for entry in kernels.values():  # the page extrema as the super-pages' placeholders, which it does not read)
        for name, counts in entry["read"].items():
            for part in name.split("="):
                reads[part.removeprefix("PT_")] += counts["unique"]  # (the page-top programs' own arguments)
    assert reads["HALVES"] == 0
    if decide_once:  # the page bounds spread over page-top programs, which the estimate's launch runs
        assert argument(kernels["bulk_estimate_kernel"]["read"], "PT_KMIN")["unique"] > 0
    pages = state["kmin"].shape[2]
    assert 0 < reads["KMIN"] == reads["KMAX"] <= b * H_kv * pages * d * 2
    written = sum(counts["unique"] for entry in kernels.values() for name, counts in entry["written"].items()
                  if "HALVES" in name.split("="))
    assert written == b * H_kv * 2 * d * 4  # one page per (row, KV head)


def test_totals_count_every_kv_cache_argument_as_kv():
    """The cache is ``K`` and ``V`` in the attention launches and ``KEYS`` in the moment step's (the step's key, and
    the window's keys where that launch decides)."""
    reads = {"KEYS": {"unique": 10, "accessed": 12}, "Q=SINKS": {"unique": 3, "accessed": 3},
             "COUNT=KEYS": {"unique": 0, "accessed": 0}}  # (a placeholder for keys it does not read)
    kernels = {"moment": {"read": reads, "written": {}}, "split": {"read": {"K": {"unique": 5, "accessed": 5}},
                                                                  "written": {}}}
    counted = totals(kernels)
    assert counted["kv_unique"] == 15 and counted["other_read_unique"] == 3 and counted["read_accessed"] == 20


def test_spans_name_one_tensor_passed_twice_after_both_arguments():
    import numpy as np

    q = torch.zeros(4)
    spans = ArgumentSpans(["Q", "SINKS", "K"], [q, q, torch.zeros(2)])
    assert list(spans.split(np.array([q.data_ptr() + 4], dtype=np.uint64))) == ["Q=SINKS"]
