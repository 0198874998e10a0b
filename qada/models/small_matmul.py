"""An Inductor graph pass for the compiled layer step: small matrix products become fused loops.

A decode step's products have a handful of rows: the ``G`` query heads of a KV group against the window's keys
(``[H_kv, G, d] @ [H_kv, d, W]``), the heavy keys, the cov's quadratic form, the page bounds
(``[H_kv, G, 2d] @ [H_kv, 2d, pages]``). Inductor hands every ``bmm`` / ``mm`` to the BLAS library, one call per
product: on a 2-core CPU each costs ~35 us in place (a thread team for three rows), four per ``qada_tail`` step.
:class:`SmallMatmulPass` rewrites those with at most :data:`MAX_ROWS` rows on either side as
``(a[..., :, :, None] * b[..., None, :, :]).sum(-2)``, which Inductor fuses into the loops around them: nothing is
materialised and no library call is made. Measured on SmolLM2 at 7.68k with decode steps interleaved in one process
(``benchmarks/interleaved.py``): a ``qada_tail`` step 6.5% and a ``qada`` step 5% faster.

A product whose reduction runs over the rows of a gathered operand (``weights @ values[slots]``: an extra set's
or a window's values, ``[n, d]`` reduced over ``n``) would load that operand element by element once the gather is
fused into the product's loop (the loop is vectorised over the reduction, each element an indirect load with its own
bounds check). The pass has such an operand computed into a buffer of its own first (Inductor's
``force_stride_order``: a loop over the rows with ``d`` contiguous, no library call), which the product then reads.
On ``qada_tail`` with an extra set (80 values per head) at 7.68k the layer step took 335 us a call instead of 400,
in a loop over one layer's captured arguments.

Only the compiled layer step uses it (:func:`qada.models.layer_step.compile_layer_step`), on the CPU and on a CUDA
GPU, scoped to its compilation through Inductor's ``post_grad_custom_post_pass`` option: no global setting changes.
On a GPU each product was a cuBLAS launch; Inductor makes it a reduction of its own or part of the kernel that
consumes it (per layer, counted in Inductor's CUDA code made on the CPU: ``qada`` 17 -> 16 kernels, ``qada_tail``
34 -> 29). The sums' order differs from the library's, so results may differ in the last float bits from the eager
step's.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["MAX_ROWS", "SmallMatmulPass", "small_product"]

MAX_ROWS = 8
"""A product with at most this many rows (``a``'s) or columns (``b``'s) is rewritten."""

_aten = torch.ops.aten


def small_product(a_shape: torch.Size, b_shape: torch.Size) -> bool:
    """Whether ``a @ b`` (``bmm``: ``[B, M, K] @ [B, K, N]``; ``mm``: ``[M, K] @ [K, N]``) has at most
    :data:`MAX_ROWS` rows ``M`` or columns ``N``, a static size (a symbolic one is never taken for small)."""
    return any(isinstance(size, int) and size <= MAX_ROWS for size in (a_shape[-2], b_shape[-1]))


class SmallMatmulPass(CustomGraphPass):
    """Inductor's post-grad custom pass: every ``aten.bmm`` / ``aten.mm`` with a small side (:func:`small_product`)
    becomes ``sum(unsqueeze(a, -1) * unsqueeze(b, -3), -2)``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (_aten.bmm.default, _aten.mm.default):
                continue
            a, b = node.args
            a_val, b_val = a.meta.get("val"), b.meta.get("val")
            if a_val is None or b_val is None or not small_product(a_val.shape, b_val.shape):
                continue
            with graph.inserting_before(node):
                if _gathered(b) and all(isinstance(stride, int) for stride in b_val.stride()):
                    b = _realized(graph, b, b_val)  # reduced over its rows: read from a buffer, not gathered there
                rows = graph.call_function(_aten.unsqueeze.default, (a, -1))  # [..., M, K, 1]
                columns = graph.call_function(_aten.unsqueeze.default, (b, -3))  # [..., 1, K, N]
                product = graph.call_function(_aten.mul.Tensor, (rows, columns))  # [..., M, K, N]: never stored
                summed = graph.call_function(_aten.sum.dim_IntList, (product, [-2]))  # [..., M, N]
            summed.meta.update(node.meta)
            node.replace_all_uses_with(summed)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        """The pass's identity for Inductor's cache of compiled graphs: this file's contents."""
        return get_hash_for_files((__file__,))


_VIEWS = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default,
                    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.clone.default, _aten.permute.default,
                    torch.ops.prims.convert_element_type.default})


def _gathered(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a gather (``aten.index``, ``aten.gather``), seen through views, copies and dtype casts."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target in (_aten.index.Tensor, _aten.gather.default):
            return True
        if node.target not in _VIEWS:
            return False
        node = node.args[0]
    return False


def _realized(graph: torch.fx.Graph, node: torch.fx.Node, value: torch.Tensor) -> torch.fx.Node:
    """``node`` computed into a buffer of its own strides (Inductor's ``force_stride_order``, a no-op on a buffer
    that is one already)."""
    from torch._inductor import inductor_prims

    realized = graph.call_function(inductor_prims.force_stride_order, (node, list(value.stride())))
    realized.meta["val"] = value
    return realized
