"""The compiled layer step's pass that turns few-row products into fused loops (qada.models.small_matmul)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code

from qada.models.small_matmul import MAX_ROWS, SmallMatmulPass, small_product


def test_a_product_is_small_when_either_side_has_few_rows():
    assert small_product(torch.Size([3, 3, 64]), torch.Size([3, 64, 493]))  # a KV group's G heads
    assert small_product(torch.Size([3, 128, 64]), torch.Size([3, 64, MAX_ROWS]))
    assert small_product(torch.Size([1, 64]), torch.Size([64, 2048]))
    assert not small_product(torch.Size([3, MAX_ROWS + 1, 64]), torch.Size([3, 64, 128]))
    assert not small_product(torch.Size([256, 64]), torch.Size([64, 256]))


def compiled_with_pass(function):
    """``function`` compiled by Inductor with the pass (and nothing else changed)."""

    def backend(graph, inputs):
        return compile_fx(graph, inputs, config_patches={"post_grad_custom_post_pass": SmallMatmulPass()})

    return torch.compile(function, backend=backend, fullgraph=True)


def products(q, keys, bounds, big_a, big_b):
    """The shapes of a layer step's products (window scores, page bounds as a 2D product, a transposed view) and
    one large product the pass must leave to the library."""
    window = q @ keys.transpose(1, 2)  # [3, 3, 64] @ [3, 64, 128]
    pages = torch.mm(q[0], bounds)  # [3, 64] @ [64, 40]
    columns = keys @ q.transpose(1, 2)  # [3, 128, 64] @ [3, 64, 3]: few columns
    return window.softmax(-1), pages, columns, big_a @ big_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_pass_turns_small_products_into_loops_and_leaves_large_ones(dtype):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 3, 64, generator=g, dtype=dtype), torch.randn(3, 128, 64, generator=g, dtype=dtype),
            torch.randn(64, 40, generator=g, dtype=dtype), torch.randn(2, 32, 48, generator=g, dtype=dtype),
            torch.randn(2, 48, 16, generator=g, dtype=dtype))
    torch._dynamo.reset()
    results, (code, *_) = run_and_get_code(compiled_with_pass(products), *args)
    expected = products(*args)
    for result, reference in zip(results, expected, strict=True):
        torch.testing.assert_close(result, reference, rtol=1e-5, atol=1e-5)
    library_calls = code.count("extern_kernels.bmm(") + code.count("extern_kernels.mm(")
    assert library_calls == 1  # the large product only
    assert "extern_kernels.bmm(" in code


def test_the_pass_has_a_stable_identity_for_inductors_cache():
    assert SmallMatmulPass().uuid() == SmallMatmulPass().uuid()


def extra_set_attention(weights, values, slots):
    """An extra set's attention as the layer step computes it: a gathered operand reduced over its rows."""
    gathered = values[torch.arange(values.shape[0])[:, None], slots]  # [H, n, d]
    return (weights[:, None, :] @ gathered)[:, 0, :]


def window_attention_by_gather(weights, values, slots):
    """The same with ``torch.gather`` (as a window is gathered on a buffer with row bounds)."""
    index = slots[:, :, None].expand(*slots.shape, values.shape[-1])
    return (weights[:, None, :] @ torch.gather(values, 1, index))[:, 0, :]


@pytest.mark.parametrize("function", [extra_set_attention, window_attention_by_gather])
def test_a_gathered_operand_reduced_over_its_rows_is_computed_into_a_buffer_first(function, monkeypatch):
    """The gather gets a loop of its own (a buffer the product reads), not indirect loads inside the reduction; the
    result equals eager. Without the rule the gather is fused into the product's loop (no buffer)."""
    import qada.models.small_matmul as small_matmul

    g = torch.Generator().manual_seed(0)
    values = torch.randn(9, 200, 64, generator=g)
    slots = torch.randint(0, 200, (9, 80), generator=g)
    weights = torch.rand(9, 80, generator=g)
    buffer = "empty_strided_cpu((9, 80, 64)"
    for realized in (True, False):
        if not realized:
            monkeypatch.setattr(small_matmul, "_gathered", lambda node: False)
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):  # the pass's identity is its file: the same
            result, (code, *_) = run_and_get_code(compiled_with_pass(function), weights, values, slots)
        torch.testing.assert_close(result, function(weights, values, slots), rtol=1e-5, atol=1e-5)
        assert "extern_kernels.bmm(" not in code and (buffer in code) == realized, realized
