"""qada's CPU kernel for the KV groups a decode step reads in full: one pass over each head's K and V.

A read group on the CPU has a few query rows (its ``G`` heads) and thousands of keys. This kernel
(``streamed_attention.c``: an online softmax over blocks of 64 keys, each head's keys cut into chunks that the threads
share, the chunks merged by their log-sum-exps) reads them in one pass: its first, general version on a 2-core
machine inside decode steps at 8.7 GB/s, where the two BLAS products it replaced read 6.6 GB/s. Its versions compiled
for 1-8 query rows of 64 or 128 features (:func:`specialised`) hold the rows and their outputs in registers: one head
of 7.68k cold keys (3.9 MB) in ~360 us against ~490 us for the general version (~10.8 against 8 GB/s; a plain sum of
the same K/V reads ~15 GB/s) and ~710 us for PyTorch's flash attention. It is compiled by the machine's C compiler
on first use (under :func:`~qada.cache.cache_dir`, once per machine and source) and loaded with :mod:`ctypes`;
where no compiler is found or the build fails, :func:`kernel_error` says why and the ``sdpa`` executor takes its
BLAS path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from qada.cache import cache_dir

__all__ = ["balanced_chunks", "default_chunks", "kernel_error", "specialised", "streamed_attention", "streamed_fits"]

SOURCE = Path(__file__).with_name("streamed_attention.c")
# compiled with fast-math (vectorised exp, reassociated sums); linked without, so that loading the library sets no
# floating-point mode of the process (gcc links crtfastmath.o into a shared object built with -ffast-math)
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
MIN_CHUNK = 256  # keys: a shorter chunk costs more in its merge than it spreads
MAX_GROUP = 32  # query rows per head (the C source's MAX_GROUP)
SPECIALISED_GROUPS = range(1, 9)  # the C source's FIXED(G, d) versions: G query rows per head of d features
SPECIALISED_DIMS = (64, 128)


def _compiler() -> str | None:
    """``$CC``, else the first of ``cc``, ``gcc``, ``clang`` on the path."""
    return os.environ.get("CC") or next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))),
                                        None)


def _machine() -> str:
    """What a ``-march=native`` build depends on: the architecture and, on Linux, the CPU's flags."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(compiler: str, target: Path) -> None:
    """Compile :data:`SOURCE` into the shared library ``target`` (natively tuned where the compiler can): in a
    temporary folder beside it, then one rename, so that processes building at once never load half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        obj, library = Path(folder) / "kernel.o", Path(folder) / "kernel.so"
        for native in (("-march=native",), ()):
            done = subprocess.run([compiler, *COMPILE_FLAGS, *native, str(SOURCE), "-o", str(obj)],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} could not compile {SOURCE.name}: {done.stderr.strip()[:400]}")
        done = subprocess.run([compiler, *LINK_FLAGS, str(obj), "-o", str(library), "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} could not link {SOURCE.name}: {done.stderr.strip()[:400]}")
        os.replace(library, target)


@functools.cache
def _load() -> tuple[object | None, str | None]:
    """``(the kernel's C function, None)``, or ``(None, why not)``; built on the first call of a process where the
    cache holds no library for this source, compiler and machine."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler found (set CC to one)"
    digest = hashlib.sha256(b"\0".join(
        [SOURCE.read_bytes(), compiler.encode(), " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(), _machine().encode()]))
    target = cache_dir() / "kernels" / f"streamed_attention-{digest.hexdigest()[:20]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        function = ctypes.CDLL(str(target)).streamed_attention
    except (OSError, RuntimeError) as error:
        return None, f"{type(error).__name__}: {error}"
    pointer, long, integer = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    function.argtypes = [pointer, long, long, pointer, pointer, long, long, pointer, integer, integer, integer, long,
                         ctypes.c_float, integer, integer]
    function.restype = integer
    return function, None


def kernel_error() -> str | None:
    """Why the kernel cannot run in this process (no compiler, a failed build), or ``None`` where it can (building
    it now if needed)."""
    return _load()[1]


def balanced_chunks(items: int, threads: int) -> int:
    """Key chunks per item so that ``items * chunks`` work items share ``threads`` evenly: ``threads / gcd``
    (1 item on 2 threads: 2 chunks; 3 items: 2, i.e. 6 items, 3 per thread; 2 items: 1). The ``sdpa`` executor's
    split-K and :func:`default_chunks` both cut keys by it."""
    return threads // math.gcd(items, threads)


def default_chunks(heads: int, length: int, threads: int) -> int:
    """Key chunks per head: four work items per thread, a multiple of the threads in all (``heads * chunks``, four
    times :func:`balanced_chunks`), none shorter than :data:`MIN_CHUNK` keys (1 head on 2 threads: 8 chunks; 3 heads:
    8, i.e. 24 items)."""
    return max(1, min(4 * balanced_chunks(heads, threads), length // MIN_CHUNK))


def specialised(group: int, head_dim: int) -> bool:
    """Whether the kernel has a version compiled for ``group`` query rows per head of ``head_dim`` features (1-8
    rows, 64 or 128 features): the rows and their outputs held in registers through a chunk, the products unrolled.
    On a 2-core CPU (SmolLM2's 3 rows of 64, cold K/V, 1-3 heads, 1k-7.7k keys) it ran 1.3-2x faster than the
    general version and faster than PyTorch's flash attention at every size measured (7.68k keys, one head: 369
    against 713 us; two: 665 against 763); the general version was slower than flash attention for two heads."""
    return group in SPECIALISED_GROUPS and head_dim in SPECIALISED_DIMS


def streamed_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`streamed_attention` takes ``q [1, n, G, d]``, ``k, v [1, n, T, d]``: float32 on the CPU, the
    last dim contiguous, ``k`` and ``v`` of one layout (the kernel takes one set of strides for both), ``T >= 1``,
    ``G <= 32``. Cheap: it runs once per read group of a decode step."""
    float32 = torch.float32
    if not (q.dtype is float32 and k.dtype is float32 and v.dtype is float32 and q.is_cpu and k.is_cpu and v.is_cpu):
        return False
    shape = k.shape
    return (q.dim() == 4 and len(shape) == 4 and v.shape == shape and k.stride() == v.stride() and k.stride(3) == 1
            and q.stride(3) == 1 and shape[0] == 1 and shape[2] >= 1 and q.shape[0] == 1 and q.shape[1] == shape[1]
            and q.shape[3] == shape[3] and q.shape[2] <= MAX_GROUP)


def streamed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       chunks: int | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` of ``q [1, n, G, d]`` over ``k, v [1, n, T, d]`` (views of the cache, e.g. the
    strided view of a progression of KV heads; :func:`streamed_fits`), ``[n, G, d]`` out, by qada's C kernel on
    ``torch.get_num_threads()`` threads, ``chunks`` key chunks per head (``None``: :func:`default_chunks`).

    Raises:
        ValueError: the tensors do not fit the kernel.
        RuntimeError: the kernel cannot run here (:func:`kernel_error`).
    """
    if not streamed_fits(q, k, v):
        raise ValueError("streamed_attention takes float32 CPU tensors q [1, n, G, d] (G <= 32) and k, v [1, n, T, d] "
                         "(T >= 1) of one layout with a contiguous last dim, but got "
                         f"q {tuple(q.shape)} {q.dtype} {q.device}, k {tuple(k.shape)} {tuple(k.stride())}, "
                         f"v {tuple(v.shape)} {tuple(v.stride())} {v.dtype}")
    function, error = _load()
    if function is None:
        raise RuntimeError(f"qada's streamed attention kernel cannot run: {error}")
    n, G, d, T = q.shape[1], q.shape[2], q.shape[3], k.shape[2]
    threads = torch.get_num_threads()
    chunks = default_chunks(n, T, threads) if chunks is None else chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= T:
        raise ValueError(f"expected chunks an int in [1, {T}] but got {chunks!r}")
    out = torch.empty(n, G, d)
    status = function(q.data_ptr(), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(), k.stride(1), k.stride(2),
                      out.data_ptr(), n, G, d, T, float(scale), chunks, threads)
    if status == -1:
        raise MemoryError("qada's streamed attention kernel could not allocate its scratch")
    if status != 0:
        raise RuntimeError(f"qada's streamed attention kernel failed (status {status})")
    return out
