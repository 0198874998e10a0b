"""The ``triton`` executor: a split-K (flash-decoding) kernel that reads a KV group's bulk only when needed.

Per (row, KV head) the kernel builds a *virtual block list* from device values: every block of the row's real
tokens ``[start, end)`` when some head of the group is dense, else only the blocks of the sinks and of the recent
tokens (a block holding both is read once). Split-K spreads that list over a fixed number of splits; a program
computes all ``G`` query heads of its group, so a local group's bulk is neither read nor iterated over. A second
kernel merges the splits by log-sum-exp (an empty split, ``m = -inf``, ``l = 0``, gets weight 0, never
``-inf - -inf``) and writes ``[b, H, 1, d]`` in the query dtype. Two launches, no host read of tensor values,
grid and split count from the shapes and the SM count only: a step can be captured in a CUDA graph or compiled.
A soft cap is applied to the scores in the split kernel; sink logits join the denominator in the combine kernel.

Needs a CUDA device, or Triton's interpreter on CPU (``TRITON_INTERPRET=1`` set before triton is imported,
slow, for tests). Otherwise calling it raises: no silent fallback. triton is imported on the first call only.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from qada.attention.base import AttentionExecutor, GroupDecision, register_executor
from qada.stable_tensors import write_into
from qada.step import DecodeStep

__all__ = ["TRITON_DTYPES", "BudgetRank", "ExtraAttention", "HeadsDecided", "StepStatistics", "TailReads",
           "TritonExecutor", "TritonLaunch", "check_triton_runtime"]

_LOG2E = 1.4426950408889634  # the kernel works in base 2: exp(x) = exp2(x * log2(e))


TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes the Triton executors take."""


MIN_TRITON = (3, 3)
"""The oldest Triton whose compiler takes every qada kernel (``benchmarks/kernel_resources.py`` compiled them for
sm_90 with 3.3.1, 3.4.0, 3.5.1, 3.6.0 and 3.9.0); the ``triton`` extra asks for it."""
MIN_TRITON_TEXT = ".".join(map(str, MIN_TRITON))
"""It as ``major.minor``, for messages."""


def version_of(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string (``"3.4.0+git1234abcd"``: ``(3, 4)``)."""
    parts = [int(part) for part in re.findall(r"\d+", text)[:2]]
    return tuple(parts + [0] * (2 - len(parts)))


@functools.cache
def triton_version() -> tuple[int, int]:
    """The installed Triton's ``(major, minor)``, from its package metadata (``triton`` or PyTorch's nightly
    ``pytorch-triton``) without importing it, else from ``triton.__version__``; read once per process (each layer's
    launch checks it)."""
    import importlib.metadata

    for name in ("triton", "pytorch-triton"):
        try:
            return version_of(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    import triton

    return version_of(triton.__version__)


def older_triton() -> str | None:
    """The installed Triton's ``major.minor`` where it is older than :data:`MIN_TRITON` (the kernels' oldest), else
    ``None``."""
    version = triton_version()
    return ".".join(map(str, version)) if version < MIN_TRITON else None


def check_triton_runtime(device: torch.device, dtype: torch.dtype | None = None, executor: str = "triton") -> None:
    """Raise unless ``executor`` (``triton`` or ``triton_fused``) can run on ``device`` (CUDA, or CPU under the
    interpreter, set before Triton was imported) with inputs of ``dtype`` (float16, bfloat16 or float32).

    The device and installation are checked eagerly (a run's prefill calls :meth:`TritonExecutor.to_device`); while
    ``torch.compile`` traces a decode step only the dtype is, since Dynamo cannot trace the package lookup and would
    run the whole step eagerly.
    """
    if dtype is not None and dtype not in TRITON_DTYPES:
        raise ValueError(f"expected float16, bfloat16 or float32 inputs for '{executor}' but got {dtype}")
    if torch.compiler.is_compiling():
        return
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and not (device.type == "cpu" and interpret):
        raise RuntimeError(
            f"the '{executor}' executor needs a CUDA device, or Triton's interpreter for CPU tensors (set "
            f"TRITON_INTERPRET=1 before triton is imported) but got tensors on {device} with "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}; choose another executor (e.g. 'sdpa')"
        )
    if importlib.util.find_spec("triton") is None:
        raise ImportError(f"the '{executor}' executor needs triton installed: pip install 'qada[triton]'")
    found = older_triton()
    if found is not None:
        raise ImportError(f"the '{executor}' executor needs Triton {MIN_TRITON_TEXT} or later (its kernels compile "
                          f"with 3.3 to 3.9) but found {found}: pip install 'qada[triton]'")
    from qada.attention import _triton_kernel

    if device.type == "cpu" and not _triton_kernel.INTERPRETED:
        raise RuntimeError(
            f"the '{executor}' executor got CPU tensors but its kernel was compiled for the GPU: set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )


def _num_sms(device: torch.device) -> int:
    # (not functools.cache'd: dynamo traces through a cache anyway, with a warning; torch keeps the properties)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _tile(n: int) -> int:
    """A kernel's tile width for ``n`` values (head dims, query heads of a group, ...): the next power of two, at
    least 16 (``tl.dot``'s smallest operand side)."""
    return max(16, _next_pow2(n))


@register_executor("triton")
@dataclass
class TritonExecutor(AttentionExecutor):
    """Split-K (flash-decoding) kernel over a virtual block list per (row, KV head), then a log-sum-exp combine.

    Two launches per call, no host read of any tensor value, a grid fixed by the shapes: graph-capturable.

    Args:
        block_size: KV tokens per block (a power of two >= 16).
        num_splits: splits of each (row, KV head)'s block list; ``None`` = enough programs for about
            ``programs_per_sm`` per SM, at most one split per four blocks of the buffer (the interpreter counts one
            SM). Depends on the shapes and the SM count only, never on the data.
        programs_per_sm: the programs per SM that ``num_splits=None`` aims at (2). More splits make each program's
            share of a dense group shorter: a launch whose groups are part dense, part local gives each SM a more
            even share of the blocks read, and each program a shorter chain of dependent block loads.
        num_warps, num_stages: launch parameters of the split kernel on the GPU.

    ``bulk_blocks`` in the output counts the blocks loaded only for the bulk (no window token in them).
    """

    static_shapes = True

    block_size: int = 64
    num_splits: int | None = None
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 2
    _hermite_held: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False,
                                                                      compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
            raise ValueError(f"expected block_size to be a power of two >= 16 but got {bs!r}")
        optional = ("num_splits",) if self.num_splits is not None else ()
        for name in ("num_warps", "num_stages", "programs_per_sm", *optional):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} to be a positive int but got {value!r}")
        if self.num_warps & (self.num_warps - 1):  # Triton launches a power of two of warps
            raise ValueError(f"expected num_warps to be a power of two but got {self.num_warps}")

    @property
    def moment_launch(self) -> bool:
        """Whether a run's general layer step (a criterion whose decision these kernels do not make) steps the
        moment source in one launch where the source has a kernel (``moment_launch`` of
        :func:`~qada.models.layer_step.layer_step`): on a GPU, where the source's torch step compiled to several
        kernels; not under Triton's interpreter, which ``torch.compile`` cannot trace (the CPU's tests)."""
        try:
            from qada.attention import _triton_kernel
        except ImportError:  # no Triton: nothing of this executor runs
            return False
        return not _triton_kernel.INTERPRETED

    def to_device(self, device: torch.device) -> None:
        """Check, eagerly at a run's prefill, that the kernels can run on ``device`` (a compiled step does not), and
        hold the soft cap's Gauss-Hermite nodes and log weights there (:meth:`hermite_rule`): a compiled step then
        reads them as tensors it is given instead of making them from host data at every call (the same tensors from
        one sequence to the next: a CUDA graph reads them)."""
        name = "triton_fused" if getattr(self, "fuses_decision", False) else "triton"
        check_triton_runtime(torch.device(device), executor=name)
        self._hermite_held = write_into(self._hermite_held, _hermite(torch.device(device)))

    def hermite_rule(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The Gauss-Hermite nodes and ``log(w_j / sqrt(pi))`` (``[n]`` float32 each) that a soft cap's estimate
        sums over in the moment step's launch (:class:`~qada.attention.moment_step.BulkEstimate`): those held since
        :meth:`to_device`, made now where none are held on ``device`` (an executor used outside a run)."""
        if self._hermite_held is None or self._hermite_held[0].device != device:
            self.to_device(device)
        return self._hermite_held

    def splits(self, device: torch.device, pairs: int, T: int) -> int:
        """Number of splits for ``pairs = b * H_kv`` (row, KV head) programs over a buffer of ``T`` slots."""
        if self.num_splits is not None:
            return self.num_splits
        return max(1, min(_cdiv(self.programs_per_sm * _num_sms(device), pairs), _cdiv(T, self.block_size) // 4))

    def attend(self, step: DecodeStep, decision: GroupDecision) -> tuple[torch.Tensor, torch.Tensor]:
        launch = self.launch(step, decision)
        return launch.output, launch.bulk_blocks

    def attend_dense(self, step: DecodeStep,
                     add_to: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """Every head of ``step`` over its whole row (the ``dense`` criterion's decision after the group policy),
        in the two launches and nothing else: ``(output [b, H, 1, d], bulk_blocks 0-d int64, row [5] float64)``,
        the step's statistics row written by the combine launch (and added to ``sums[layer]`` with ``add_to =
        (sums, layer)``, :class:`StepStatistics`)."""
        statistics = StepStatistics.of(step, None, None, None, add_to=add_to)
        done = self.launch(step, None, statistics)
        return done.output, done.bulk_blocks, statistics.row

    def launch(self, step: DecodeStep, decision: GroupDecision | None, statistics: StepStatistics | None = None,
               pdl: bool = False, extra: ExtraAttention | None = None, rank: BudgetRank | None = None,
               heads: HeadsDecided | None = None) -> TritonLaunch:
        """Run both kernels on ``step`` (reads ``query``, ``keys``, ``values``, ``start``, ``end``, the window and
        ``decision.local``; ``decision=None``: every head dense, the ``dense`` criterion's decision after the group
        policy, nothing read for it) and return every buffer they wrote (:class:`TritonLaunch`); with
        ``statistics``, the combine launch writes the step's statistics row too, and with ``extra`` the local heads
        attend over their extra set too (:func:`combine`). ``pdl``: both as programmatic
        dependent launches (sm_90+: each may start while the launch before it runs, and waits for it before
        reading what it wrote; the caller's launch right before wrote ``decision.local`` and nothing else the split
        reads). With ``rank`` the split launch makes the budget rule's decision itself (:class:`BudgetRank`) and
        writes it into ``decision.local`` and ``decision.read`` (and ``rank.decided``, ``rank.broken``): no launch
        of its own ranks the scores. With ``heads`` (the heads decided apart by the launch before, one program per
        query head: :class:`HeadsDecided`) the split launch applies the group policy to them and writes
        ``decision.local`` and ``decision.read``."""
        query, key, value = step.query, step.keys, step.values  # [b, H, d], [b, H_kv, C, d] twice
        check_triton_runtime(query.device, query.dtype)
        from qada.attention import _triton_kernel

        b, H, d = query.shape
        H_kv, C = key.shape[1], key.shape[2]
        G = H // H_kv
        # Triton's interpreter computes bfloat16 tl.dot wrongly (checked on triton 3.9): upcast there
        dot_fp32 = _triton_kernel.INTERPRETED and query.dtype == torch.bfloat16
        BLOCK_G, BLOCK_D = _tile(G), _tile(d)
        pairs = b * H_kv
        S = self.splits(query.device, pairs, C)
        all_dense = decision is None
        local, window = query if all_dense else decision.local, step.window  # (the query: a pointer never read)
        f32 = dict(dtype=torch.float32, device=query.device)
        acc = torch.empty(pairs, S, G, d, **f32)
        m = torch.empty(pairs, S, G, **f32)
        l = torch.empty(pairs, S, G, **f32)
        counts = torch.empty(pairs, S, 2, dtype=torch.int32, device=query.device)
        start, end = step.start, step.end  # [b] long or None: read inside the kernel only
        softcap, sinks = step.softcap, step.sink_logits
        if rank is not None and heads is not None:
            raise ValueError("the split launch makes one decision: a budget's ranking (rank) or the group policy on "
                             "heads decided apart (heads), not both")
        made = rank if rank is not None else heads  # the decision the split launch makes itself, if any
        ranked = () if made is None else made.kernel_inputs(decision, b, H, H_kv)
        run = _triton_kernel.run  # (a graph break under the interpreter: torch.compile must not trace it)
        run(
            _triton_kernel.qada_decode_split_kernel, (pairs, S),
            query, key, value, local, query if start is None else start, query if end is None else end,
            acc, m, l, counts, *(ranked or (query,) * 5),
            *query.stride(), *key.stride(), *value.stride(), *((0, 0) if all_dense else local.stride()),
            C, H_kv, window.t_sink, window.t_local, S,
            float(step.scale) * (1.0 if softcap else _LOG2E), float(softcap or 1.0),
            G=G, D=d, BLOCK_G=BLOCK_G, BLOCK_N=self.block_size, BLOCK_D=BLOCK_D,
            HAS_START=start is not None, HAS_END=end is not None,
            INPUT_PRECISION="ieee" if query.dtype == torch.float32 or dot_fp32 else None,
            DOT_FP32=dot_fp32, SOFTCAP=bool(softcap), ALL_DENSE=all_dense, RANK=rank is not None,
            BLOCK_H=_tile(H), BLOCK_KV=_tile(H_kv), PER_GROUP=rank is not None and rank.per_group,
            PROMOTE=made is not None and made.promote, POLICY=heads is not None,
            num_warps=self.num_warps, num_stages=self.num_stages, **pdl_launch_options(pdl),
        )  # fmt: skip
        output, bulk_blocks = combine(query, acc, m, l, counts, sinks, statistics, pdl, extra)
        return TritonLaunch(output, bulk_blocks, acc, m, l, counts)


def _hermite(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gauss-Hermite nodes and ``log(w_j / sqrt(pi))`` as float32 tensors on ``device`` (an executor makes them
    once, at a run's prefill, and holds them: :meth:`TritonExecutor.to_device`)."""
    from qada.functional.capping import hermite_rule

    nodes, log_weights = hermite_rule()
    return (torch.tensor(nodes, dtype=torch.float32, device=device),
            torch.tensor(log_weights, dtype=torch.float32, device=device))


class StepStatistics(NamedTuple):
    """What the combine launch reads to write a layer step's statistics row as well (:func:`combine`'s
    ``statistics``): the row of :func:`~qada.models.step_parts.statistics_row`, computed on the device in the
    launch's last program instead of a dozen torch operations.

    Attributes:
        local: ``[b, H]`` bool after the group policy; ``read``: ``[b, H_kv]`` bool; ``broken``: ``[b, H]`` bool,
            the heads forced dense (all contiguous). All three ``None``: the ``dense`` criterion's step (every row
            with a bulk reads it, every head of a row without one is local, none forced dense), computed from the
            bounds.
        start, end: the rows' bounds ``[b]`` (``None``: 0, and the cache's ``length``).
        length: the cache's slots ``C``; ``t_local``: the window's size.
        row: ``[5]`` float64, written: sparsity, kv_sparsity, 1, heads forced dense, kv_read.
        tail_reads: the sizes of a tail-aware criterion's exact set (:class:`TailReads`), whose reads
            :func:`~qada.criteria.tail.exact_set_reads` counts in kv_read; ``None``: no extra reads.
        add_to: ``(sums [L, 5] float64, layer)`` with ``layer`` a 0-d or ``[1]`` int64 index: the row is also added
            to ``sums[layer]`` (a run's :attr:`~qada.models.statistics.DecodeStatistics.sums`); ``None``: not.
    """

    local: torch.Tensor | None
    read: torch.Tensor | None
    broken: torch.Tensor | None
    start: torch.Tensor | None
    end: torch.Tensor | None
    length: int
    t_local: int
    row: torch.Tensor
    tail_reads: TailReads | None = None
    add_to: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, step: DecodeStep, local: torch.Tensor | None, read: torch.Tensor | None, broken: torch.Tensor | None,
           tail_reads: TailReads | None = None,
           add_to: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepStatistics:
        """The statistics of ``step`` (its bounds, cache slots and window) with these flags, a new ``row`` to write."""
        row = torch.empty(5, dtype=torch.float64, device=step.query.device)
        return cls(local, read, broken, step.start, step.end, step.keys.shape[2], step.window.t_local, row, tail_reads,
                   add_to)


class TailReads(NamedTuple):
    """The sizes :func:`~qada.criteria.tail.exact_set_reads` counts a tail-aware criterion's reads by: pages of
    ``page_size`` slots, ``heavy`` heavy tokens per KV head, ``pages`` top pages per query head, a hierarchy of
    ``super_page`` pages per super-page (0: one level) with ``super_pages`` bounded per KV group, and whether
    local heads attend over the exact set (``attend_exact``: its values are read too)."""

    page_size: int
    heavy: int
    pages: int
    super_page: int = 0
    super_pages: int = 0
    attend_exact: bool = False


class ExtraAttention(NamedTuple):
    """Each head's attention over an extra set of bulk tokens, for the combine launch to merge into the local heads'
    output (:func:`combine`'s ``extra``): ``m, l [b, H]`` and ``acc [b, H, d]`` float32, contiguous, one more split
    of each head (log2 domain, unnormalised: ``m = -inf, l = 0, acc = 0`` for an empty set), and ``local [b, H]``
    bool, contiguous: the heads that take it (a dense head's bulk holds the set already)."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 - the split's name
    acc: torch.Tensor
    local: torch.Tensor


def pdl_launch_options(pdl: bool) -> dict[str, bool]:
    """A launch's keyword arguments for a programmatic dependent launch or an ordinary one: the kernels' ``PDL``
    (always given: torch's analysis of what a kernel writes needs every argument), and Triton's ``launch_pdl`` only
    with it (Triton's interpreter never sees it)."""
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


SM_REGISTERS = 65536
"""Registers of one SM of the NVIDIA GPUs Triton compiles for (sm_80, sm_90: A100, H100, H200), allocated per warp in
units of 256, at most 255 a thread."""


def register_cap(num_warps: int, programs: int) -> dict[str, int]:
    """Launch options that cap a kernel's registers per thread so that ``programs`` programs of ``num_warps`` warps
    fit on one SM (:data:`SM_REGISTERS`): ``{"maxnreg": n}``, 168 for three programs of four warps. Triton's
    interpreter drops the option; ``torch.compile`` (Inductor, torch 2.11 to 2.13) compiles the kernels it
    launches without it."""
    if isinstance(num_warps, bool) or isinstance(programs, bool) or num_warps < 1 or programs < 1:
        raise ValueError(f"expected num_warps and programs >= 1 but got {num_warps!r} and {programs!r}")
    per_warp = SM_REGISTERS // (programs * num_warps) // 256 * 256
    if per_warp < 32 * 32:  # (no kernel of qada's computes in fewer)
        raise ValueError(f"expected a cap of at least 32 registers a thread but {programs} programs of {num_warps} "
                         f"warps leave {per_warp // 32}")
    return {"maxnreg": min(255, per_warp // 32)}


def combine(query: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, counts: torch.Tensor,
            sinks: torch.Tensor | None, statistics: StepStatistics | None = None,
            pdl: bool = False, extra: ExtraAttention | None = None,
            rider: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine launch: the splits ``acc [pairs, S, G, d]``, ``m, l [pairs, S, G]``, ``counts [pairs, S, 2]``
    of a split kernel for ``query [b, H, d]`` (and the sink logits ``[H]`` or ``None``) merged into ``(output [b,
    H, 1, d]`` in the query dtype, ``bulk_blocks`` 0-d int64); with ``statistics``, its ``row`` written too; with
    ``extra``, the local heads also attend over their extra set (:class:`ExtraAttention`). ``pdl``: as a
    programmatic dependent launch right after the split launch (it waits for it first). ``rider``: a
    :class:`~qada.attention.moment_step.MomentRider`, the moment step for the next decode step that the same launch
    runs besides (:mod:`qada.attention._ahead_kernel`), or ``None``."""
    from qada.attention import _triton_kernel

    b, H, d = query.shape
    pairs, S, G = m.shape
    output = torch.empty(b, H, 1, d, dtype=query.dtype, device=query.device)
    # a 0-d view of a 1-element buffer: Inductor lowers a 0-d ``empty`` to a kernel that fills it with zeros (one
    # launch per layer in a compiled step), a 1-d one to no kernel; a whole-tensor view, not an element (``[0]``),
    # which a kernel writing it would make Inductor copy and scatter back
    bulk_blocks = torch.empty(1, dtype=torch.int64, device=query.device).view(())
    BLOCK_S = _next_pow2(S)
    stats = statistics if statistics is not None else StepStatistics(m, m, m, None, None, 0, 0, m)
    all_dense = stats.local is None
    if all_dense != (stats.read is None) or all_dense != (stats.broken is None):
        raise ValueError("expected local, read and broken all given or all None (the dense criterion's step)")
    if all_dense:
        stats = stats._replace(local=m, read=m, broken=m)  # (pointers the kernel does not read)
    if statistics is not None:
        flag_shapes = () if all_dense else (("local", stats.local, (b, H)), ("read", stats.read, (b, H // G)),
                                            ("broken", stats.broken, (b, H)))
        for name, tensor, shape in (*flag_shapes, ("row", stats.row, (5,))):
            if tuple(tensor.shape) != shape or not tensor.is_contiguous():
                raise ValueError(f"expected a contiguous {name} of shape {list(shape)} but got {tuple(tensor.shape)}")
        if statistics.add_to is not None:
            sums, layer = statistics.add_to
            if sums.dim() != 2 or sums.shape[1] != 5 or sums.dtype != torch.float64 or not sums.is_contiguous() \
                    or layer.numel() != 1 or layer.dtype != torch.long or sums.device != query.device \
                    or layer.device != query.device:
                raise ValueError(f"expected add_to as (contiguous float64 sums [L, 5], one int64 layer index) on the "
                                 f"query's device {query.device} but got {sums.dtype} {tuple(sums.shape)} on "
                                 f"{sums.device} and {layer.dtype} {tuple(layer.shape)} on {layer.device}")
    if extra is not None:
        for name, tensor, shape, dtype in (("m", extra.m, (b, H), torch.float32), ("l", extra.l, (b, H), torch.float32),
                                           ("acc", extra.acc, (b, H, d), torch.float32),
                                           ("local", extra.local, (b, H), torch.bool)):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
                raise ValueError(f"expected the extra set's {name} as a contiguous {dtype} tensor of shape "
                                 f"{list(shape)} but got {tensor.dtype} {tuple(tensor.shape)}")
    flags = (stats.local, stats.read, stats.broken)  # bool read as bytes (a dtype view would not lower in Inductor)
    reads = stats.tail_reads or TailReads(1, 0, 0)
    sums, layer = stats.add_to or (stats.row, stats.row)
    extras = (extra.m, extra.l, extra.acc, extra.local) if extra is not None else (m, m, m, m)
    kernel, grid, riding, rider_constants = _triton_kernel.qada_decode_combine_kernel, (b * H + 1,), (), {}
    if rider is not None:  # the moment step's programs beside the combine's (module _ahead_kernel)
        from qada.attention import _ahead_kernel

        kernel = getattr(_ahead_kernel, rider.kernel)
        grid = (max(b * H + 1, rider.pairs), 1 + rider.programs)
        riding, rider_constants = (b * H, *rider.args), rider.constants
    _triton_kernel.run(
        kernel, grid,
        acc, m, l, counts, output, bulk_blocks, m if sinks is None else sinks.contiguous(),
        *flags, m if stats.start is None else stats.start, m if stats.end is None else stats.end, stats.row, sums,
        layer, *extras,
        output.stride(0), output.stride(1), output.stride(3),
        H, S, pairs * S, stats.length, stats.t_local, reads.page_size, reads.heavy, reads.pages, reads.super_page,
        reads.super_pages, 2 if reads.attend_exact else 1, *riding,
        **rider_constants,
        G=G, D=d, BLOCK_S=BLOCK_S, CHUNK_S=min(BLOCK_S, 16), BLOCK_D=_tile(d), BLOCK_C=256,
        HAS_SINKS=sinks is not None, STATS=statistics is not None, HAS_START=stats.start is not None,
        HAS_END=stats.end is not None, TAIL_READS=stats.tail_reads is not None, ADD=stats.add_to is not None,
        EXTRA=extra is not None, ALL_DENSE=all_dense, **pdl_launch_options(pdl),
    )  # fmt: skip
    return output, bulk_blocks


class BudgetRank(NamedTuple):
    """The budget rule of ``qada_budget`` and ``qada_tail_budget`` as the split launch makes it
    (:meth:`TritonExecutor.launch`'s ``rank``, the split kernel's ``RANK`` mode,
    :func:`~qada.attention._budget_rank.budget_group_decision`): every program ranks its row's heads by ``score``
    and attends as its own KV group's heads decide; split 0 of each (row, KV head) writes the decision.

    Attributes:
        score: ``[b, H]`` float32 (contiguous), each head's score (NaN where an input is: never local).
        count: 0-d int64 on the device, the heads (with ``per_group``: KV groups) of each row that are local.
        per_group: rank KV groups by their heads' minimum score instead of heads.
        promote: the ``promote`` group policy (a group reading its bulk makes its local heads attend over it).
        decided, broken: ``[b, H]`` bool (contiguous), written: the rule's decision (every head of a row without a
            bulk local) and the heads forced dense by a non-finite score.
    """

    score: torch.Tensor
    count: torch.Tensor
    per_group: bool
    promote: bool
    decided: torch.Tensor
    broken: torch.Tensor

    def kernel_inputs(self, decision: GroupDecision | None, b: int, H: int, H_kv: int) -> tuple[torch.Tensor, ...]:
        """``(SCORE, COUNT, DECIDED, BROKEN, READ)`` as the split kernel takes them, after checking them and the
        ``decision`` it writes into (``local [b, H]``, ``read [b, H_kv]``, bool, contiguous); no host read."""
        if decision is None:
            raise ValueError("a budget ranked in the split launch writes its decision into decision.local and "
                             "decision.read: pass them")
        if self.count.shape != () or self.count.dtype != torch.long:
            raise ValueError(f"expected the budget's count as a 0-d int64 tensor but got {self.count.dtype} "
                             f"{tuple(self.count.shape)}")
        _check_flags((("score", self.score, (b, H), torch.float32), ("decided", self.decided, (b, H), torch.bool),
                      ("broken", self.broken, (b, H), torch.bool), ("local", decision.local, (b, H), torch.bool),
                      ("read", decision.read, (b, H_kv), torch.bool)))
        return self.score, self.count, self.decided, self.broken, decision.read


class HeadsDecided(NamedTuple):
    """Heads decided apart, one program per query head (the ``qada_tail`` decision launch's ``HEADS_APART``), for
    the split launch to apply the group policy to (:meth:`TritonExecutor.launch`'s ``heads``, the split kernel's
    ``POLICY`` mode, :func:`~qada.attention._group_decision.policy_of_heads`): every program reads its KV group's
    heads' decisions and attends as the policy makes them; split 0 of each (row, KV head) writes ``decision.local``
    and ``decision.read``. No program of the decision launch sees its whole group, so none can.

    Attributes:
        decided: ``[b, H]`` bool (contiguous), each head's own decision (every head of a row without a bulk local).
        promote: the ``promote`` group policy (a group reading its bulk makes its local heads attend over it).
    """

    decided: torch.Tensor
    promote: bool

    def kernel_inputs(self, decision: GroupDecision | None, b: int, H: int, H_kv: int) -> tuple[torch.Tensor, ...]:
        """``(SCORE, COUNT, DECIDED, BROKEN, READ)`` as the split kernel takes them (only ``DECIDED`` and ``READ``
        used), after checking them and the ``decision`` it writes into; no host read."""
        if decision is None:
            raise ValueError("the group policy applied in the split launch writes decision.local and decision.read: "
                             "pass them")
        _check_flags((("decided", self.decided, (b, H), torch.bool), ("local", decision.local, (b, H), torch.bool),
                      ("read", decision.read, (b, H_kv), torch.bool)))
        return self.decided, self.decided, self.decided, self.decided, decision.read


def _check_flags(expected: tuple[tuple[str, torch.Tensor, tuple[int, ...], torch.dtype], ...]) -> None:
    """Raise unless each ``(name, tensor, shape, dtype)`` of ``expected`` is a contiguous tensor of that shape and
    dtype (what a split launch that decides reads and writes)."""
    for name, tensor, shape, dtype in expected:
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"expected {name} as a contiguous {dtype} tensor of shape {list(shape)} but got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")


class TritonLaunch(NamedTuple):
    """What one :meth:`TritonExecutor.launch` wrote (``pairs = b * H_kv``, ``S`` splits).

    Attributes:
        output: ``[b, H, 1, d]`` in the query dtype.
        bulk_blocks: 0-d int64, blocks loaded only for the bulk, summed over every program.
        acc, m, l: ``[pairs, S, G, d]``, ``[pairs, S, G]`` twice, float32: each split's unnormalised output,
            running max (log2 domain) and sum; an empty split holds ``0, -inf, 0``.
        counts: ``[pairs, S, 2]`` int32 per program: blocks loaded only for the bulk, blocks loaded in all.
    """

    output: torch.Tensor
    bulk_blocks: torch.Tensor
    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor
    counts: torch.Tensor
