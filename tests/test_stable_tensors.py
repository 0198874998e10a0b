"""qada.stable_tensors: a new sequence's values written into the tensors a recorded CUDA graph reads."""

from __future__ import annotations

import torch

from qada.stable_tensors import same_layout, write_into


def nested(seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.tensor(3), {"mean": torch.randn(2, 4, generator=g)},
            {"tail": {"kmin": torch.randn(2, 3, generator=g), "none": None}}, [torch.randn(5, generator=g)])


def test_same_layout_compares_structure_shapes_dtypes_and_devices():
    assert same_layout(nested(0), nested(1)) and same_layout(None, None)
    a = nested(0)
    assert not same_layout(a, (*a[:3], [torch.randn(6)]))  # another shape
    assert not same_layout(a, (torch.tensor(3.0), *a[1:]))  # another dtype
    assert not same_layout(a, (torch.tensor(3, device="meta"), *a[1:]))  # another device
    assert not same_layout(a, (*a[:1], {"mean": a[1]["mean"], "cov": a[1]["mean"]}, *a[2:]))  # another key
    assert not same_layout(a, a[:3]) and not same_layout([a[0]], (a[0],))  # length, container type
    assert not same_layout({"x": None}, {"x": torch.zeros(1)}) and not same_layout(torch.zeros(1), None)


def test_write_into_keeps_the_tensors_and_takes_the_new_values():
    kept, new = nested(0), nested(1)
    pointers = [kept[1]["mean"].data_ptr(), kept[2]["tail"]["kmin"].data_ptr(), kept[3][0].data_ptr()]
    out = write_into(kept, new)
    assert out is kept
    assert [out[1]["mean"].data_ptr(), out[2]["tail"]["kmin"].data_ptr(), out[3][0].data_ptr()] == pointers
    assert torch.equal(out[1]["mean"], new[1]["mean"]) and torch.equal(out[3][0], new[3][0])
    assert torch.equal(out[2]["tail"]["kmin"], new[2]["tail"]["kmin"])


def test_write_into_takes_the_new_tensors_where_nothing_can_be_kept():
    new = nested(1)
    assert write_into(None, new) is new  # a first sequence
    other = (torch.tensor(3), {"mean": torch.zeros(3, 4)}, *nested(0)[2:])
    kept = nested(0)
    assert write_into(kept, other) is other and not torch.equal(kept[1]["mean"][:1], other[1]["mean"][:1])


def test_memory_shared_by_both_is_not_copied():
    base = torch.arange(12.0).view(3, 4)
    kept = {"row": base[1]}
    assert write_into(kept, {"row": base[1]})["row"] is kept["row"]  # a view of the same memory: left as it is
    assert torch.equal(base[1], torch.tensor([4.0, 5.0, 6.0, 7.0]))
