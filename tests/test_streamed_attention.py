"""qada's streamed CPU kernel for the KV groups a decode step reads in full (qada.attention.streamed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qada.attention.streamed as streamed
from qada.attention import EXECUTORS
from qada.attention.streamed import default_chunks, kernel_error, specialised, streamed_attention, streamed_fits

needs_kernel = pytest.mark.skipif(kernel_error() is not None, reason=f"the kernel cannot run here: {kernel_error()}")


def reference(q, k, v, scale):
    """``softmax(q k^T * scale) v`` in float64: ``q [1, n, G, d]``, ``k, v [1, n, T, d]`` -> ``[n, G, d]``."""
    scores = q[0].double() @ k[0].double().transpose(-1, -2) * scale
    return torch.softmax(scores, -1) @ v[0].double()


def cache_views(n, G, d, T, step, spare, seed):
    """``q [1, n, G, d]`` and views ``k, v [1, n, T, d]`` of a buffer with ``step * n`` KV heads and ``T + spare``
    slots, as the executor takes them: every ``step``-th head (one strided view), the first ``T`` slots."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n * step, G, d, generator=g)[:, ::step]
    k, v = (3 * torch.randn(1, n * step, T + spare, d, generator=g) for _ in range(2))
    return q, k[:, ::step, :T], v[:, ::step, :T]


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 4), G=st.sampled_from([1, 3, 4, 7, 16, 32]), d=st.sampled_from([8, 64, 80, 128]),
       T=st.integers(1, 2500), step=st.integers(1, 2), spare=st.sampled_from([0, 37]), chunks=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_equals_the_softmax_reference(n, G, d, T, step, spare, chunks, seed):
    """Any heads, group size, head dim, length (blocks of 64 keys cut anywhere), strided views and chunk count:
    the float64 softmax attention, to float32 rounding."""
    q, k, v = cache_views(n, G, d, T, step, spare, seed)
    chunks = min(chunks, T)
    out = streamed_attention(q, k, v, d**-0.5, chunks=chunks)
    assert out.shape == (n, G, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, k, v, d**-0.5), atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("G", range(1, 10))
def test_each_compiled_shape_and_the_general_version_equal_the_reference(G, d):
    """The versions compiled for 1-8 query rows of 64 or 128 features (:func:`specialised`), and 9 rows, which take
    the general version: strided views, three chunks, a length that is no multiple of the block."""
    assert specialised(G, d) == (G <= 8)
    q, k, v = cache_views(2, G, d, 1500, 2, 13, seed=G + d)
    torch.testing.assert_close(streamed_attention(q, k, v, d**-0.5, chunks=3).double(), reference(q, k, v, d**-0.5),
                               atol=2e-5, rtol=2e-5)


def test_specialised_names_the_compiled_shapes():
    assert specialised(3, 64) and specialised(8, 128) and specialised(1, 64)
    assert not specialised(9, 64) and not specialised(3, 80) and not specialised(0, 64) and not specialised(4, 256)


@needs_kernel
@pytest.mark.parametrize("G, d, expected", [(3, 64, {"streamed_attention"}), (3, 16, set())])
def test_the_executor_streams_every_read_group_of_a_compiled_shape(monkeypatch, G, d, expected):
    """Two of three KV groups read, keys too few to split (``_chunks`` is 1): a compiled shape attends by the
    kernel anyway (faster than flash attention at every length measured), another shape by flash attention as
    before; the output equals the reference either way."""
    import qada.attention.sdpa as sdpa
    from tests.test_attention_fastpaths import check_against_reference, make_case

    taken = []
    function = sdpa.streamed_attention
    monkeypatch.setattr(sdpa, "streamed_attention", lambda *a: taken.append("streamed_attention") or function(*a))
    case = make_case(1, 3 * G, 3, 700, d, None, "dense", torch.float32, seed=9)
    case = (*case[:3], torch.tensor([[True] * G + [False] * 2 * G]), *case[4:])  # group 0 local, groups 1-2 read
    check_against_reference(EXECUTORS.build("sdpa"), case)
    assert set(taken) == expected


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_default_chunks_on_any_threads_equal_the_reference(threads):
    """The chunks it picks by itself, on one thread and on two (the merge of chunks from several threads)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        q, k, v = cache_views(3, 3, 64, 7680, 1, 200, seed=1)
        torch.testing.assert_close(streamed_attention(q, k, v, 0.125).double(), reference(q, k, v, 0.125),
                                   atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(before)


def test_default_chunks_spread_the_heads_over_the_threads():
    """Four work items per thread, a multiple of the threads in all, none shorter than MIN_CHUNK keys."""
    assert default_chunks(1, 7680, 2) == 8 and default_chunks(3, 7680, 2) == 8 and default_chunks(2, 7680, 2) == 4
    assert default_chunks(1, 7680, 1) == 4
    assert default_chunks(1, 600, 2) == 2 and default_chunks(1, 100, 2) == 1


@needs_kernel
def test_a_large_score_gap_keeps_the_probabilities_exact():
    """Keys whose scores differ by thousands (one chunk's maximum far below another's): the chunk that loses
    weighs exp(very negative) = 0, no overflow, no NaN (the kernel is compiled with fast-math)."""
    q, k, v = cache_views(1, 2, 16, 1000, 1, 0, seed=3)
    k[0, 0, 700] = 400 * q[0, 0, 0] / q[0, 0, 0].norm()  # one key far ahead of all others for query row 0
    out = streamed_attention(q, k, v, 1.0, chunks=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k, v, 1.0), atol=2e-5, rtol=2e-5)


@needs_kernel
def test_loading_it_leaves_denormals_alone():
    """Compiled with fast-math but linked without it: loading the library sets no flush-to-zero mode (gcc would
    link crtfastmath.o into a shared object built with -ffast-math, changing every later float of the process)."""
    assert kernel_error() is None  # loaded
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 0.5).item() != 0.0


@pytest.mark.parametrize("case", ["float64", "last dim strided", "k and v of two layouts", "no keys", "G > 32",
                                  "batch of 2", "head dims differ"])
def test_tensors_it_cannot_take_are_refused(case):
    """Each input the kernel cannot read is a ValueError naming what it takes, never a wrong answer;
    :func:`streamed_fits` says so beforehand (the executor's check)."""
    q, k, v = cache_views(2, 3, 16, 50, 1, 0, seed=0)
    if case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "last dim strided":
        k, v = (torch.randn(1, 2, 50, 32)[..., ::2] for _ in range(2))
    elif case == "k and v of two layouts":
        v = v.contiguous()
        k = torch.randn(1, 2, 60, 16)[:, :, :50]
    elif case == "no keys":
        k, v = k[:, :, :0], v[:, :, :0]
    elif case == "G > 32":
        q = torch.randn(1, 2, 33, 16)
    elif case == "batch of 2":
        q, k, v = (x.expand(2, *x.shape[1:]) for x in (q, k, v))
    elif case == "head dims differ":
        q = torch.randn(1, 2, 3, 8)
    assert not streamed_fits(q, k, v)
    with pytest.raises(ValueError, match="streamed_attention takes float32 CPU tensors"):
        streamed_attention(q, k, v, 0.25)


@needs_kernel
@pytest.mark.parametrize("chunks", [0, 51, True, 2.0])
def test_a_chunk_count_outside_one_to_the_length_is_refused(chunks):
    q, k, v = cache_views(1, 3, 16, 50, 1, 0, seed=0)
    with pytest.raises(ValueError, match=r"expected chunks an int in \[1, 50\]"):
        streamed_attention(q, k, v, 0.25, chunks=chunks)


def test_without_a_compiler_the_executor_takes_its_blas_path(monkeypatch, tmp_path):
    """No C compiler (``CC`` names none, an empty cache): :func:`kernel_error` says so, the kernel refuses with that
    reason, and the ``sdpa`` executor's read groups take the two BLAS products instead, with the same output."""
    import qada.attention.sdpa as sdpa
    from tests.test_attention_fastpaths import check_against_reference, make_case

    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path / "cache"))
    streamed._load.cache_clear()
    try:
        assert "no-such-compiler" in kernel_error()
        q, k, v = cache_views(1, 3, 16, 50, 1, 0, seed=0)
        with pytest.raises(RuntimeError, match="streamed attention kernel cannot run"):
            streamed_attention(q, k, v, 0.25)
        taken = []
        for name in ("products_attention", "streamed_attention"):
            function = getattr(sdpa, name)
            monkeypatch.setattr(sdpa, name, lambda *a, _f=function, _n=name: taken.append(_n) or _f(*a))
        executor = EXECUTORS.build("sdpa", splits=2, min_split=16)
        check_against_reference(executor, make_case(1, 9, 3, 300, 16, None, "dense", torch.float32, seed=5))
        assert set(taken) == {"products_attention"}
    finally:
        streamed._load.cache_clear()  # the next caller loads the real kernel again


def test_the_build_is_cached(monkeypatch, tmp_path):
    """A fresh cache gets one library, built once: a second load in the same cache builds nothing."""
    if streamed._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path))
    builds = []
    build = streamed._build
    monkeypatch.setattr(streamed, "_build", lambda *a: builds.append(a) or build(*a))
    streamed._load.cache_clear()
    try:
        assert kernel_error() is None
        streamed._load.cache_clear()
        assert kernel_error() is None
        assert len(builds) == 1 and len(list((tmp_path / "kernels").glob("streamed_attention-*.so"))) == 1
    finally:
        streamed._load.cache_clear()
