"""The moment step's kernel (:mod:`qada.attention.moment_step`, chosen by
:func:`~qada.models.fused_step.fused_moment_step`) against the sources' own torch steps: the same
float64 state and float32 moments after every step, over rows with left padding, head dims that are not a power of
two, steps that add keys and steps where the stored range jumps. On CPU it runs in Triton's interpreter."""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from qada.models.fused_step import fused_moment_step  # noqa: E402
from qada.moments import CurrentMoments, StoredMoments  # noqa: E402
from qada.moments.reference import ReferenceKeys  # noqa: E402
from qada.window import Window  # noqa: E402
from tests.test_attention_triton import DEVICE  # noqa: E402

WINDOW = Window(t_local=8, t_sink=2)
STARTS = torch.tensor([0, 5])


def source(kind: str, d: int, H_kv: int = 2, **options):
    if kind == "current":
        return CurrentMoments(**options)
    reference = ReferenceKeys(torch.randn(1, H_kv, 64, d, generator=torch.Generator().manual_seed(1)) + 0.5)
    stored = StoredMoments(offset=12, min_bulk_keys=4, **options)
    stored.set_reference(reference)
    return stored


def prefilled(kind: str, d: int, T: int = 15, capacity: int = 40):
    """``(source, buffer keys [2, 2, capacity, d], state clones for the torch step and for the kernel)``."""
    keys = torch.randn(2, 2, capacity, d, generator=torch.Generator().manual_seed(2)) * 2 + 1
    moments = source(kind, d)
    moments.prefill(0, keys[:, :, :T], STARTS, WINDOW, capacity=capacity)
    state = moments.step_state(0)
    def clone():
        return {name: (t.clone() if name not in ("ref", "shift") else t).to(DEVICE) for name, t in state.items()}
    return moments, keys.to(DEVICE), clone(), clone()


@pytest.mark.parametrize("kind", ["current", "stored"])
@pytest.mark.parametrize("d", [16, 24, 40])
def test_kernel_step_equals_the_source_step(kind, d):
    """Every state tensor and both moments, after each of 12 steps: equal to float64 rounding (the float32
    moments to their last bit). Row 1 (start 5) reaches the stored source's short-prompt switch: its range jumps.
    d = 40: two blocks of 32 (the second partly masked), so an off-diagonal block pair too."""
    moments, keys, eager, kernel = prefilled(kind, d)
    start = STARTS.to(DEVICE)
    for end in range(16, 28):
        ends = torch.full((2,), end, device=DEVICE)
        expected = moments.step(eager, keys, start, ends, WINDOW)
        got = fused_moment_step(moments, kernel, keys, start, ends, WINDOW)
        assert got is not None
        for name in eager:
            torch.testing.assert_close(kernel[name], eager[name], rtol=1e-12, atol=1e-12, msg=f"{name} at {end}")
        torch.testing.assert_close(got.mean, expected.mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.cov, expected.cov, rtol=1e-6, atol=1e-6)
        assert torch.equal(got.cov, got.cov.transpose(-1, -2))  # symmetric, as to_bulk_moments makes it
    if kind == "stored":
        assert kernel["count"][1].sum() > 0 and kernel["count"][0].sum() > 0  # both rows have a range
    assert not torch.equal(kernel["cov"] if kind == "stored" else kernel["out_cov"], torch.zeros_like(got.cov))


@pytest.mark.parametrize("kind", ["current", "stored"])
def test_kernel_step_without_padding(kind):
    """``start=None``: every row starts at slot 0."""
    moments, keys, eager, kernel = prefilled(kind, 16)
    for end in (16, 17, 18):
        ends = torch.full((2,), end, device=DEVICE)
        moments.step(eager, keys, None, ends, WINDOW)
        fused_moment_step(moments, kernel, keys, None, ends, WINDOW)
    for name in eager:
        torch.testing.assert_close(kernel[name], eager[name], rtol=1e-12, atol=1e-12, msg=name)


def test_kernel_catches_a_wrong_update():
    """Not vacuous: a state one step behind differs."""
    moments, keys, eager, kernel = prefilled("current", 16)
    start = STARTS.to(DEVICE)
    moments.step(eager, keys, start, torch.full((2,), 16, device=DEVICE), WINDOW)
    fused_moment_step(moments, kernel, keys, start, torch.full((2,), 16, device=DEVICE), WINDOW)
    fused_moment_step(moments, kernel, keys, start, torch.full((2,), 17, device=DEVICE), WINDOW)
    assert not torch.allclose(kernel["m2"], eager["m2"])


@pytest.mark.parametrize("kind", ["current", "stored"])
def test_one_program_per_block_pair_and_the_count_back_at_zero(monkeypatch, kind):
    """d = 40 (blocks of 32: three block pairs): three programs per (row, KV head), the last of them to finish
    updating the count and the sums the others read; the state's ``arrived`` is 0 again after every launch (what
    the next step, or a CUDA graph's replay, starts from)."""
    from qada.attention.moment_step import block_pairs
    from tests.triton_launches import LaunchRecorder

    assert (block_pairs(40, 3), block_pairs(64, 3), block_pairs(16, 3), block_pairs(40, 16)) == (3, 3, 1, 10)
    moments, keys, eager, kernel = prefilled(kind, 40)
    start = STARTS.to(DEVICE)
    record = LaunchRecorder(monkeypatch)
    for end in (16, 17, 18):
        ends = torch.full((2,), end, device=DEVICE)
        moments.step(eager, keys, start, ends, WINDOW)
        fused_moment_step(moments, kernel, keys, start, ends, WINDOW)
        assert torch.equal(kernel["arrived"], torch.zeros_like(kernel["arrived"]))
    assert [grid for _, grid in record.launches] == [(4, 3)] * 3  # (2 rows x 2 KV heads, 3 block pairs)
    for name in eager:
        torch.testing.assert_close(kernel[name], eager[name], rtol=1e-12, atol=1e-12, msg=name)


def grid_order() -> contextlib.AbstractContextManager:
    """Under Triton's interpreter, its programs one after the other in grid order even where a test runs with
    ``--program-order`` (for a test that shows what goes wrong in that order); on a GPU nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return contextlib.nullcontext()
    from qada.attention.interpreter import program_order

    return program_order("natural")


@pytest.mark.parametrize("kind", ["current", "stored"])
def test_the_block_pairs_read_the_old_count_and_sums(kind):
    """Not vacuous: a count that does not start at 0 makes the first block pair's program the "last" one, which
    updates the count and the sums (``current``: the mean) before the other pairs read them: the moments go wrong
    (in grid order: interleaved, the other pairs may have read them before)."""
    moments, keys, eager, kernel = prefilled(kind, 40)
    start = STARTS.to(DEVICE)
    kernel["arrived"].fill_(2)
    ends = torch.full((2,), 16, device=DEVICE)
    expected = moments.step(eager, keys, start, ends, WINDOW)
    with grid_order():
        got = fused_moment_step(moments, kernel, keys, start, ends, WINDOW)
    assert not torch.allclose(got.cov, expected.cov, rtol=1e-4, atol=1e-4)


def test_a_state_without_its_arrival_count_is_an_error():
    """A state of several block pairs without ``arrived`` (the count a prefill declares) is refused, not run."""
    moments, keys, _, kernel = prefilled("current", 40)
    del kernel["arrived"]
    with pytest.raises(ValueError, match="'arrived'"):
        fused_moment_step(moments, kernel, keys, STARTS.to(DEVICE), torch.full((2,), 16, device=DEVICE), WINDOW)


def no_launches(monkeypatch):
    from qada.attention import _triton_kernel

    monkeypatch.setattr(_triton_kernel, "run", lambda *a, **k: pytest.fail("launched"))


def test_frozen_current_runs_nothing(monkeypatch):
    moments = CurrentMoments(freeze=True)
    keys = torch.randn(2, 2, 20, 16)
    moments.prefill(0, keys[:, :, :15], STARTS, WINDOW, capacity=20)
    state = moments.step_state(0)
    no_launches(monkeypatch)
    got = fused_moment_step(moments, state, keys, STARTS, torch.full((2,), 16), WINDOW)
    assert got.mean is state["out_mean"] and got.cov is state["out_cov"]


@pytest.mark.parametrize("make", [lambda: CurrentMoments(update_every=2),
                                  lambda: type("Mine", (CurrentMoments,), {})()], ids=["blocks", "subclass"])
def test_other_sources_step_in_torch(monkeypatch, make):
    """A source the kernel does not know (or a subclass, which may change the step) takes its own step."""
    keys = torch.randn(2, 2, 20, 16, generator=torch.Generator().manual_seed(4))
    mine, plain = make(), make()
    for moments in (mine, plain):
        moments.prefill(0, keys[:, :, :15], STARTS, WINDOW, capacity=20)
    no_launches(monkeypatch)
    for end in (16, 17):
        ends = torch.full((2,), end)
        got = fused_moment_step(mine, mine.step_state(0), keys, STARTS, ends, WINDOW)
        expected = plain.step(plain.step_state(0), keys, STARTS, ends, WINDOW)
    torch.testing.assert_close(got.cov, expected.cov, rtol=0, atol=0)


def test_moment_kernels_compile_for_the_gpu():
    """Both kernels, without the estimate, with it (soft-capped), with the decision too and with a ``qada_tail``
    step's page-top programs, spread over block pairs and not, and the estimate's own kernel lower to PTX for sm_90
    (no GPU needed): what runs on an H100."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from qada.attention import _estimate_kernel as E, _moment_kernel as K
        pointers = {"COUNT": "*fp64", "MEAN": "*fp64", "M2": "*fp64", "OUT_MEAN": "*fp32", "OUT_COV": "*fp32",
                    "KEYS": "*bf16", "START": "*i64", "END": "*i64", "S1": "*fp64", "S2": "*fp64", "OLD_END": "*i64",
                    "JUMP_N": "*i64", "JUMP_COUNT": "*fp64", "JUMP_S1": "*fp64", "JUMP_S2": "*fp64", "COV": "*fp32",
                    "REF": "*fp32", "SHIFT": "*fp64", "Q": "*bf16", "LME": "*fp32", "GH_X": "*fp32",
                    "GH_LOGW": "*fp32", "K": "*bf16", "SINKS": "*fp32", "DECIDED": "*u8", "LOCAL": "*u8",
                    "READ": "*u8", "BROKEN": "*u8", "PT_Q": "*bf16", "PT_K": "*bf16", "PT_START": "*i64",
                    "PT_END": "*i64", "PT_KMIN": "*bf16", "PT_KMAX": "*bf16", "PT_VALS": "*fp32", "PT_IDS": "*i32",
                    "PT_OKS": "*i32", "ARRIVED": "*i32", "SHARES": "*fp32"}
        floats = {"scale": "fp32", "softcap": "fp32", "log_tau": "fp32", "pt_scale": "fp32"}
        for estimate, decide, tops, spread in ((False, False, False, True), (True, False, False, True),
                                               (True, True, False, True), (True, False, True, True),
                                               (True, True, True, False)):
            constants = {"D": 128, "BLOCK_T": 32, "BLOCK_D": 128, "HAS_START": True, "ESTIMATE": estimate, "G": 4,
                         "BLOCK_G": 16, "BLOCK_E": 4, "BLOCK_X": 32, "SOFTCAP": estimate, "DECIDE": decide,
                         "BLOCK_N": 64, "END_GIVEN": decide, "HAS_SINKS": decide, "PROMOTE": decide, "PDL": decide,
                         "SPREAD": spread, "INPUT_PRECISION": None, "DOT_FP32": False, "PAGE_TOPS": tops, "PT_G": 4,
                         "PT_D": 128, "PT_BLOCK_G": 16, "PT_BLOCK_D": 128, "PT_BLOCK_P": 32, "PT_PAGE": 16, "PT_TOP": 8,
                         "PT_BLOCK_M": 8, "PT_HAS_START": True, "PT_HAS_END": True}
            for kernel in (K.current_moment_step_kernel, K.stored_moment_step_kernel, E.bulk_estimate_kernel):
                names = kernel.arg_names
                kinds = dict(pointers, MEAN="*fp64" if "M2" in names else "*fp32")
                signature = {n: kinds.get(n, "constexpr" if n in constants else floats.get(n, "i32")) for n in names}
                source = ASTSource(kernel, signature, constexprs={(names.index(n),): c for n, c in constants.items()
                                                                  if n in names})
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


# --- the estimate's query side: log E[exp(s)] from the new moments ------------------------------------------------

def estimate_of(query, softcap=None, **executor):
    from qada.attention.fused import FusedTritonExecutor

    return FusedTritonExecutor(**executor).bulk_estimate(query, 0.25, softcap)


def eager_log_mean_exp(query, moments, softcap):
    """:attr:`~qada.step.DecodeStep.log_mean_exp_bulk` of ``query`` on ``moments``: the eager criterion's value."""
    from qada.step import DecodeStep

    keys = torch.zeros(query.shape[0], moments.mean.shape[1], 1, query.shape[-1], device=query.device)
    return DecodeStep(query, keys, 0.25, WINDOW, moments=moments, softcap=softcap).log_mean_exp_bulk


@pytest.mark.parametrize("kind", ["current", "stored"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "capped"])
@pytest.mark.parametrize(("d", "heads"), [(24, 6), (40, 6), (40, 16)])
def test_kernel_step_writes_each_heads_log_mean_exp(kind, softcap, d, heads):
    """With a :class:`~qada.attention.moment_step.BulkEstimate` the moment step's launch also writes each query
    head's ``log E[exp(s)]`` (3 or 8 heads per KV head; d = 24: one block pair, d = 40: three, or ten of 16 with 8
    heads (:func:`~qada.attention.moment_step.block_sizes`)): the eager criterion's value from the new moments, and
    what the estimate's own launch computes from them (what a source stepped in torch gets): bit for bit in Triton's
    interpreter; on a GPU, where each kernel is compiled on its own (its operations contracted into FMAs its own
    way; measured on an H200: equal to 4 decimals, not bit for bit), within float32 rounding."""
    from qada.attention.moment_step import estimate_launch

    moments, keys, _, kernel = prefilled(kind, d)
    query = torch.randn(2, heads, d, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 2
    start = STARTS.to(DEVICE)
    for end in (16, 17, 21):
        estimate = estimate_of(query, softcap)
        got = fused_moment_step(moments, kernel, keys, start, torch.full((2,), end, device=DEVICE), WINDOW, estimate)
        expected = eager_log_mean_exp(query, got, softcap)
        assert expected.isfinite().all() and expected.std() > 0.1
        torch.testing.assert_close(estimate.out, expected, rtol=1e-5, atol=1e-5)
        again = estimate_of(query, softcap)
        if DEVICE.type == "cpu":
            assert torch.equal(estimate_launch(again, got), estimate.out)
        else:
            torch.testing.assert_close(estimate_launch(again, got), estimate.out, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("make", [lambda: CurrentMoments(freeze=True), lambda: CurrentMoments(update_every=2)],
                         ids=["frozen", "blocks"])
def test_sources_without_a_kernel_step_get_the_estimate_in_one_launch(monkeypatch, make):
    """A frozen source (no step) or one that steps in torch: one launch, the estimate's own."""
    from tests.triton_launches import LaunchRecorder

    moments = make()
    keys = torch.randn(2, 2, 20, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    moments.prefill(0, keys[:, :, :15], STARTS.to(DEVICE), WINDOW, capacity=20)
    query = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    estimate = estimate_of(query)
    record = LaunchRecorder(monkeypatch)
    got = fused_moment_step(moments, moments.step_state(0), keys, STARTS.to(DEVICE), torch.full((2,), 16,
                            device=DEVICE), WINDOW, estimate)  # fmt: skip
    assert [name for name, _ in record.launches] == ["bulk_estimate_kernel"]
    torch.testing.assert_close(estimate.out, eager_log_mean_exp(query, got, None), rtol=1e-5, atol=1e-5)



def page_tops_of(query, keys, ends, pages_per_program=3, page=4, top=2, seed=8):
    """A :class:`~qada.attention.page_tops.PageTops` over random page extrema of ``keys [b, H_kv, C, d]`` (pages of
    ``page`` slots) with new lists, for the launch that writes ``log E[exp(s)]`` to carry."""
    from qada.attention.fused import _next_pow2, page_top_tile
    from qada.attention.page_tops import PageTops

    b, H_kv, C, d = keys.shape
    n_pages = -(-C // page)
    g = torch.Generator().manual_seed(seed)
    kmin = torch.randn(b, H_kv, n_pages, d, generator=g).to(DEVICE)
    kmax = kmin + torch.rand(b, H_kv, n_pages, d, generator=g).to(DEVICE)
    shape = (b * H_kv, -(-n_pages // pages_per_program), max(16, _next_pow2(query.shape[1] // H_kv)), _next_pow2(top))
    lists = [torch.full(shape, -7, dtype=dtype, device=DEVICE) for dtype in (torch.float32, torch.int32, torch.int32)]
    return PageTops(query, keys, STARTS.to(DEVICE), ends, kmin, kmax, *lists, 0.25, WINDOW.t_sink, WINDOW.t_local,
                    pages_per_program, page, top, page_top_tile(d, pages_per_program))


@pytest.mark.parametrize("make", [lambda: source("current", 16), lambda: source("stored", 16),
                                  lambda: CurrentMoments(update_every=2)], ids=["current", "stored", "torch-step"])
def test_the_estimate_launch_runs_the_page_top_programs_too(monkeypatch, make):
    """A ``qada_tail`` step's page-top programs ride in the launch that writes ``log E[exp(s)]`` (the moment step's
    kernel, or the estimate's own after a torch step): one launch, grid ``(pairs, 1 + stretches)``; the state, the
    moments and ``log E[exp(s)]`` bit for bit those of the launch without them, the lists bit for bit those of the
    page-top launch of their own."""
    from qada.attention.fused import FusedTritonExecutor
    from tests.triton_launches import LaunchRecorder

    keys = torch.randn(2, 2, 40, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 2 + 1
    query = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ends = torch.tensor([30, 27], device=DEVICE)
    plain, riding = make(), make()
    for moments in (plain, riding):
        moments.prefill(0, keys[:, :, :26], STARTS.to(DEVICE), WINDOW, capacity=40)
    tops, alone = page_tops_of(query, keys, ends), page_tops_of(query, keys, ends)
    assert tops.stretches == 4  # 10 pages of 4 slots, 3 a program
    expected = estimate_of(query)
    without = fused_moment_step(plain, plain.step_state(0), keys, STARTS.to(DEVICE), ends, WINDOW, expected)
    estimate = FusedTritonExecutor().bulk_estimate(query, 0.25, None, page_tops=tops)
    record = LaunchRecorder(monkeypatch)
    got = fused_moment_step(riding, riding.step_state(0), keys, STARTS.to(DEVICE), ends, WINDOW, estimate)
    assert [grid for _, grid in record.launches] == [(4, 5)]
    assert torch.equal(estimate.out, expected.out)
    assert torch.equal(got.mean, without.mean) and torch.equal(got.cov, without.cov)
    for name, tensor in plain.step_state(0).items():
        assert torch.equal(riding.step_state(0)[name], tensor), name
    FusedTritonExecutor()._launch_page_tops(alone)
    for got_list, expected_list in zip(tops.lists(), alone.lists(), strict=True):
        assert torch.equal(got_list, expected_list)
    assert (tops.ids[..., :3, :2] != -7).all() and (tops.oks[..., :3, :2] == 1).any()  # every list written

def test_block_sizes():
    """The block pairs' side: 32 where the estimate's running sum allows it (``BLOCK_E BLOCK_T^2 <= 4096``), never
    more than the padded head dimension, at least 8."""
    from qada.attention.moment_step import block_sizes

    assert block_sizes(64, 3) == {"BLOCK_D": 64, "BLOCK_E": 4, "BLOCK_T": 32}  # SmolLM2: three pairs
    assert block_sizes(128, 4) == {"BLOCK_D": 128, "BLOCK_E": 4, "BLOCK_T": 32}  # Llama-3-8B: ten pairs
    assert block_sizes(128, 8)["BLOCK_T"] == 16 and block_sizes(256, 2)["BLOCK_T"] == 32
    assert block_sizes(16, 1) == {"BLOCK_D": 16, "BLOCK_E": 1, "BLOCK_T": 16}
    assert block_sizes(64, 64)["BLOCK_T"] == 8  # at least 8, however many heads


def test_estimate_checks_its_output():
    from qada.attention.moment_step import BulkEstimate

    estimate = estimate_of(torch.randn(2, 6, 16))
    with pytest.raises(ValueError, match="multiple of 4 heads"):
        estimate.kernel_constants(4)
    wrong = BulkEstimate(*estimate[:5], torch.empty(2, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"contiguous float32 output of shape \[2, 6\]"):
        wrong.kernel_constants(3)


@pytest.mark.parametrize("kind", ["current", "stored"])
@pytest.mark.parametrize(("d", "heads"), [(40, 6), (40, 16)])
def test_the_launch_not_spread_over_block_pairs_is_the_same_step(monkeypatch, kind, d, heads):
    """The executor's ``spread_moments=False``: one program per (row, KV head) taking every block pair in turn
    (3 or 10 of them), the launch before the step was spread; the same state, moments and estimate as the spread
    launch, the estimate bit for bit (its shares summed in the same order)."""
    from tests.triton_launches import LaunchRecorder

    moments, keys, spread_state, state = prefilled(kind, d)
    query = torch.randn(2, heads, d, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 2
    start = STARTS.to(DEVICE)
    record = LaunchRecorder(monkeypatch)
    for end in (16, 17, 21):
        ends = torch.full((2,), end, device=DEVICE)
        spread = estimate_of(query)
        alone = estimate_of(query, spread_moments=False)
        assert spread.spread and not alone.spread
        fused_moment_step(moments, spread_state, keys, start, ends, WINDOW, spread)
        fused_moment_step(moments, state, keys, start, ends, WINDOW, alone)
        for name in state:
            torch.testing.assert_close(state[name], spread_state[name], rtol=1e-12, atol=1e-12, msg=name)
        if DEVICE.type == "cpu":
            assert torch.equal(alone.out, spread.out)
        else:
            torch.testing.assert_close(alone.out, spread.out, rtol=2e-6, atol=2e-6)
    pairs = 3 if heads == 6 else 10
    assert [grid for _, grid in record.launches] == [(4, pairs), (4,)] * 3


def test_spread_moments_must_be_a_bool():
    from qada.attention.fused import FusedTritonExecutor

    with pytest.raises(ValueError, match="spread_moments"):
        FusedTritonExecutor(spread_moments="no")
