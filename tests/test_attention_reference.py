"""The reference executor against hand computations; group policy, sparsity counts, validation, registry."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import qada.attention  # noqa: F401  (registers every executor)
from qada.attention import EXECUTORS, ReferenceExecutor, apply_group_policy, decode_attention
from qada.functional import local_index_set
from qada.window import Window


def _hand_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """softmax(q k_I^T / sqrt(d)) v_I for one head: q [d], k, v [T, d] in float64."""
    s = (k[index].double() @ q.double()) / math.sqrt(q.shape[0])
    return torch.softmax(s, dim=0) @ v[index].double()


def _case(b, H, H_kv, T, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, 1, d, generator=g)
    k = torch.randn(b, H_kv, T, d, generator=g) * 2
    v = torch.randn(b, H_kv, T, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("T", [1, 5, 8, 9, 13, 30])
def test_reference_matches_hand_computation_unpadded(T):
    window = Window(8, 3)
    q, k, v = _case(1, 4, 2, T, 6, seed=T)
    local = torch.tensor([[True, False, False, True]])
    out = decode_attention(ReferenceExecutor(), q, k, v, local, window).output
    index = local_index_set(T, window.t_local, window.t_sink)
    for h in range(4):
        kv = h // 2
        expected = _hand_attention(q[0, h, 0], k[0, kv], v[0, kv], index if local[0, h] else torch.arange(T))
        torch.testing.assert_close(out[0, h, 0].double(), expected, atol=1e-5, rtol=1e-5)
    if T > window.t_local:  # a dense head really differs from the local one
        dense_0 = _hand_attention(q[0, 0, 0], k[0, 0], v[0, 0], torch.arange(T))
        assert not torch.allclose(out[0, 0, 0].double(), dense_0, atol=1e-3)


def test_reference_matches_hand_computation_left_padded():
    window = Window(6, 2)
    T = 20
    start = torch.tensor([0, 3, 13, 16])  # 20, 17, 7 (> T_local) and 4 (< T_local) real tokens
    q, k, v = _case(4, 2, 1, T, 5, seed=1)
    local = torch.tensor([[True, False], [True, False], [False, True], [True, False]])
    res = decode_attention(ReferenceExecutor(), q, k, v, local, window, start=start)
    for r in range(4):
        s = int(start[r])
        for h in range(2):
            index = s + (local_index_set(T - s, 6, 2) if local[r, h] else torch.arange(T - s))
            expected = _hand_attention(q[r, h, 0], k[r, 0], v[r, 0], index)
            torch.testing.assert_close(res.output[r, h, 0].double(), expected, atol=1e-5, rtol=1e-5)
    # the last row has no bulk: every head counts as local and no bulk is read there
    assert res.local.tolist() == [[True, False], [True, False], [False, True], [True, True]]
    assert res.sparsity.item() == pytest.approx(5 / 8)
    assert res.kv_sparsity.item() == pytest.approx(1 / 4)


def test_output_dtype_and_scale():
    q, k, v = _case(1, 2, 2, 12, 4)
    local = torch.tensor([[False, True]])
    res = decode_attention(ReferenceExecutor(), q.half(), k.half(), v.half(), local, (4, 1), scale=0.3)
    assert res.output.dtype == torch.float16 and res.output.shape == (1, 2, 1, 4)
    s = (k[0, 0].double() @ q[0, 0, 0].double()) * 0.3
    expected = torch.softmax(s, 0) @ v[0, 0].double()
    torch.testing.assert_close(res.output[0, 0, 0].double(), expected, atol=5e-3, rtol=5e-3)


def test_group_policy_counts_by_hand():
    # b=2, H=6, H_kv=3 (G=2); row 1 has no bulk
    local = torch.tensor([[True, True, True, False, False, False], [False, True, False, False, True, True]])
    has_bulk = torch.tensor([True, False])
    eff, read = apply_group_policy(local, has_bulk, 3, "exact")
    assert read.tolist() == [[False, True, True], [False, False, False]]
    assert eff.tolist() == [[True, True, True, False, False, False], [True] * 6]
    eff, read = apply_group_policy(local, has_bulk, 3, "promote")
    assert read.tolist() == [[False, True, True], [False, False, False]]
    assert eff.tolist() == [[True, True, False, False, False, False], [True] * 6]
    with pytest.raises(ValueError, match="expected group_policy in"):
        apply_group_policy(local, has_bulk, 3, "lazy")


@pytest.mark.parametrize("policy", ["exact", "promote"])
def test_reported_sparsity_by_hand(policy):
    q, k, v = _case(2, 4, 2, 40, 4)
    local = torch.tensor([[True, True, True, False], [False, False, True, True]])
    res = decode_attention(
        ReferenceExecutor(group_policy=policy), q, k, v, local, Window(8, 2), start=torch.tensor([0, 5])
    )
    # groups: row 0 -> (local, mixed), row 1 -> (dense, local); bulk read for 2 of 4 (row, KV head) pairs
    assert res.kv_sparsity.item() == pytest.approx(0.5)
    expected_local = 5 if policy == "exact" else 4
    assert res.sparsity.item() == pytest.approx(expected_local / 8)
    assert res.sparsity.ndim == 0 and res.kv_sparsity.ndim == 0 and res.bulk_blocks is None


def test_promote_gives_full_attention_to_promoted_heads():
    q, k, v = _case(1, 4, 2, 50, 8, seed=3)
    local = torch.tensor([[True, False, True, True]])  # head 0 shares KV head 0 with dense head 1
    window = Window(8, 2)
    promoted = decode_attention(ReferenceExecutor(group_policy="promote"), q, k, v, local, window)
    exact = decode_attention(ReferenceExecutor(group_policy="exact"), q, k, v, local, window)
    dense = decode_attention(ReferenceExecutor(), q, k, v, torch.zeros_like(local), window)
    torch.testing.assert_close(promoted.output[0, :2], dense.output[0, :2])
    torch.testing.assert_close(promoted.output[0, 2:], exact.output[0, 2:])
    assert not torch.allclose(exact.output[0, 0], dense.output[0, 0], atol=1e-3)
    assert promoted.local.tolist() == [[False, False, True, True]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query": torch.zeros(1, 2, 2, 4)}, "one decode step"),
        ({"key": torch.zeros(1, 2, 9, 5)}, "expected key of shape"),
        ({"value": torch.zeros(1, 2, 8, 4)}, "expected value of shape"),
        ({"key": torch.zeros(1, 3, 9, 4), "value": torch.zeros(1, 3, 9, 4)}, "multiple of the number of KV"),
        ({"value": torch.zeros(1, 2, 9, 4, dtype=torch.float64)}, "of one dtype"),
        ({"local": torch.zeros(1, 2)}, "expected local to be a bool tensor"),
        ({"local": torch.zeros(2, 2, dtype=torch.bool)}, "expected local to be a bool tensor"),
        ({"start": torch.zeros(2, dtype=torch.long)}, "expected start of shape"),
        ({"start": torch.zeros(1)}, "integer tensor"),
        ({"scale": -1.0}, "expected scale"),
    ],
)
def test_invalid_inputs_raise(kwargs, match):
    args = {
        "query": torch.zeros(1, 2, 1, 4),
        "key": torch.zeros(1, 2, 9, 4),
        "value": torch.zeros(1, 2, 9, 4),
        "local": torch.zeros(1, 2, dtype=torch.bool),
        "window": Window(4, 1),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        decode_attention(ReferenceExecutor(), **args)


def test_import_is_cheap():
    """Importing the executors imports neither triton nor the compiler stack."""
    code = "import sys, qada.attention; print(sorted(m for m in ('triton', 'torch._inductor') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", EXECUTORS.names())
def test_every_executor_builds_and_round_trips(name):
    assert {"reference", "sdpa", "flex", "triton"} <= set(EXECUTORS.names())
    executor = EXECUTORS.build(name)
    assert executor.group_policy == "exact"
    config = executor.to_config()
    assert config["name"] == name
    rebuilt = EXECUTORS.build(config)
    assert type(rebuilt) is type(executor) and rebuilt == executor
    promoted = EXECUTORS.build({**config, "group_policy": "promote"})
    assert promoted.to_config()["group_policy"] == "promote"
    with pytest.raises(ValueError, match=r"expected group_policy in \('exact', 'promote'\) but got 'x'"):
        EXECUTORS.build(name, group_policy="x")
