"""The ``sdpa`` and ``flex`` executors equal the reference over generated shapes, masks, dtypes and policies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qada.attention  # noqa: F401  (registers every executor)
from qada.attention import EXECUTORS, ExecutorOutput, decode_attention
from qada.window import Window

WINDOW = Window(16, 4)
TOLERANCE = {  # (atol, rtol) against the float32 reference cast to the input dtype
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def make_case(b, H, H_kv, T, d, starts, mask, dtype, seed=0):
    """Random ``q [b,H,1,d]``, ``K, V [b,H_kv,T,d]``, ``local [b,H]`` of a kind, ``start [b]`` or None."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, 1, d, generator=g)
    k = torch.randn(b, H_kv, T, d, generator=g) * 1.5
    v = torch.randn(b, H_kv, T, d, generator=g)
    if mask == "local":
        local = torch.ones(b, H, dtype=torch.bool)
    elif mask == "dense":
        local = torch.zeros(b, H, dtype=torch.bool)
    elif mask == "mixed":
        local = torch.rand(b, H, generator=g) < 0.5
    elif mask == "one_group_local":  # some KV groups fully local (bulk skipped), others mixed
        local = torch.rand(b, H, generator=g) < 0.5
        local.view(b, H_kv, H // H_kv)[:, 0] = True
        local.view(b, H_kv, H // H_kv)[:, -1, 0] = False
    else:
        raise ValueError(mask)
    start = None if starts is None else torch.tensor(starts)
    return q.to(dtype), k.to(dtype), v.to(dtype), local, start


def check_against_reference(executor, case, window=WINDOW) -> ExecutorOutput:
    q, k, v, local, start = case
    ref = decode_attention(
        EXECUTORS.build("reference", group_policy=executor.group_policy), q, k, v, local, window, start=start
    )
    got = decode_attention(executor, q, k, v, local, window, start=start)
    assert got.output.shape == q.shape and got.output.dtype == q.dtype
    atol, rtol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got.output.float(), ref.output.float(), atol=atol, rtol=rtol)
    assert torch.equal(got.local, ref.local)
    assert got.sparsity.ndim == 0 and got.kv_sparsity.ndim == 0
    torch.testing.assert_close(got.sparsity, ref.sparsity)
    torch.testing.assert_close(got.kv_sparsity, ref.kv_sparsity)
    return got


FAST = ["sdpa", "flex_eager"]


def build(name: str, policy: str):
    if name == "flex_eager":
        return EXECUTORS.build("flex", group_policy=policy, compile=False)
    return EXECUTORS.build(name, group_policy=policy)


SHAPES = [  # (b, H, H_kv, T, d, starts)
    (1, 4, 4, 7, 8, None),  # T < T_local: no bulk
    (1, 4, 2, 16, 8, None),  # T == T_local
    (1, 4, 1, 17, 8, None),  # one bulk token
    (3, 8, 2, 45, 16, [0, 9, 30]),  # left padding; last row has exactly T_local - 1 real tokens
    (2, 4, 1, 131, 32, [3, 0]),
    (2, 8, 4, 99, 16, [98, 50]),  # a row with a single real token
]


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(x) for x in s[:5]))
@pytest.mark.parametrize("mask", ["local", "dense", "mixed", "one_group_local"])
@pytest.mark.parametrize("policy", ["exact", "promote"])
def test_fast_path_equals_reference_float32(name, shape, mask, policy):
    b, H, H_kv, T, d, starts = shape
    check_against_reference(build(name, policy), make_case(b, H, H_kv, T, d, starts, mask, torch.float32, seed=T))


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", ["exact", "promote"])
def test_fast_path_equals_reference_half(name, dtype, policy):
    case = make_case(2, 8, 2, 77, 16, [0, 20], "one_group_local", dtype, seed=1)
    check_against_reference(build(name, policy), case)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 3),
    H_kv=st.integers(1, 3),
    G=st.sampled_from([1, 2, 4]),
    T=st.integers(1, 150),
    d=st.sampled_from([4, 8, 16]),
    t_local=st.integers(1, 40),
    t_sink_frac=st.floats(0, 1),
    policy=st.sampled_from(["exact", "promote"]),
    mask=st.sampled_from(["local", "dense", "mixed", "one_group_local"]),
    name=st.sampled_from(FAST),
    data=st.data(),
)
def test_fast_path_equals_reference_generated(b, H_kv, G, T, d, t_local, t_sink_frac, policy, mask, name, data):
    window = Window(t_local, int(t_sink_frac * t_local))
    starts = data.draw(st.one_of(st.none(), st.lists(st.integers(0, T - 1), min_size=b, max_size=b)))
    case = make_case(b, H_kv * G, H_kv, T, d, starts, mask, torch.float32, seed=T)
    check_against_reference(build(name, policy), case, window)


def test_sdpa_skips_full_attention_for_local_groups():
    """Full attention is computed only for read groups: poison the keys of a skipped group's bulk."""
    q, k, v, local, start = make_case(2, 4, 2, 60, 8, [0, 10], "dense", torch.float32)
    local[:, :2] = True  # KV head 0 is local in both rows: its bulk must never be read
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, 0, 20:40] = float("nan")  # inside both rows' bulk: [4, 48) and [14, 48)
    poisoned_v[:, 0, 20:40] = float("nan")
    got = decode_attention(EXECUTORS.build("sdpa"), q, poisoned_k, poisoned_v, local, WINDOW, start=start)
    ref = decode_attention(EXECUTORS.build("reference"), q, k, v, local, WINDOW, start=start)
    torch.testing.assert_close(got.output, ref.output, atol=2e-5, rtol=2e-5)


def test_flex_block_lists_skip_the_bulk_by_hand():
    from qada.attention.flex import _kv_blocks

    # T = 100, blocks of 16 (7 blocks), window (16, 4): row 0 real [0, 100), bulk [4, 88); row 1 real [40, 100)
    start = torch.tensor([0, 40])
    dense = torch.tensor([[False, True], [False, True]])
    kv_num, kv_indices = _kv_blocks(start, torch.full_like(start, 100), dense, Window(16, 4), 7, 16)
    assert kv_num[:, :, 0].tolist() == [[3, 7], [3, 5]]  # local: the sink block + the recent blocks only
    assert kv_indices[0, 0, 0, :3].tolist() == [0, 5, 6]  # [0, 4) in block 0, [88, 100) in blocks 5, 6
    assert kv_indices[1, 0, 0, :3].tolist() == [2, 5, 6]  # row 1's sinks [40, 44) in block 2
    assert kv_num.dtype == torch.int32 and kv_indices.shape == (2, 2, 1, 7)
    kv_num, kv_indices = _kv_blocks(start, torch.full_like(start, 100), dense, Window(16, 0), 7, 16)
    assert kv_indices[0, 0, 0, :2].tolist() == [5, 6] and kv_num[:, 0, 0].tolist() == [2, 2]  # no sinks
    assert kv_indices[1, 0, 0, :2].tolist() == [5, 6]  # block 2 holds row 1's first token but no sink


def test_flex_bucket_lengths():
    flex = EXECUTORS.build("flex", block_size=16)
    assert [flex.bucket_length(T) for T in (1, 16, 17, 32, 33, 64, 65, 200)] == [16, 16, 32, 32, 64, 64, 128, 256]
    with pytest.raises(ValueError, match="expected block_size to be a power of two"):
        EXECUTORS.build("flex", block_size=24)
    with pytest.raises(ValueError, match="expected compile in"):
        EXECUTORS.build("flex", compile="yes")


def test_flex_without_compiler_warns_or_raises(monkeypatch):
    monkeypatch.setattr("qada.attention.flex.shutil.which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    case = make_case(1, 2, 1, 40, 8, None, "mixed", torch.float32)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        decode_attention(EXECUTORS.build("flex", compile=True), *case[:4], WINDOW)
    with pytest.warns(UserWarning, match="uncompiled"):
        check_against_reference(EXECUTORS.build("flex"), case)


def test_flex_compiled_reuses_block_mask_without_recompiling():
    """One compilation per bucket: later steps change local, starts and T inside the bucket, no recompile."""
    import torch._dynamo

    from qada.attention.flex import flex_compile_support

    reason = flex_compile_support(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"torch.compile(flex_attention) is not available on this CPU: {reason}")
    torch._dynamo.reset()
    flex = EXECUTORS.build("flex", compile=True, block_size=32)
    steps = [(70, [0, 5], "mixed"), (71, [2, 70], "one_group_local"), (90, [1, 30], "dense")]
    for i, (T, starts, mask) in enumerate(steps):  # all in the 128 bucket
        case = make_case(2, 4, 2, T, 16, starts, mask, torch.float32, seed=i)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            check_against_reference(flex, case)
    assert len(flex._states) == 1


@pytest.mark.slow
def test_compiled_flex_on_cpu_with_the_embedded_model_shape():
    """Regression: inductor's CPU flex template did not compile a block mask without 'full' blocks (torch 2.13)."""
    from qada.attention import EXECUTORS
    from qada.attention.flex import flex_compile_support

    if flex_compile_support(torch.device("cpu")) is not None:
        pytest.skip("flex_attention cannot be compiled here")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 64, generator=g) for h, n in ((9, 1), (3, 1000), (3, 1000)))
    flex, reference = EXECUTORS.build("flex", compile=True), EXECUTORS.build("reference")
    for local in (torch.zeros(1, 9, dtype=torch.bool), torch.tensor([[True] * 6 + [False] * 3])):
        torch.testing.assert_close(
            decode_attention(flex, q, k, v, local).output,
            decode_attention(reference, q, k, v, local).output,
            atol=1e-5,
            rtol=1e-5,
        )


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("mask", ["dense", "mixed", "one_group_local"])
@pytest.mark.parametrize("T", [300, 301, 513])
@pytest.mark.parametrize("path", ["split_k_attention", "products_attention", "streamed_attention"])
def test_sdpa_split_k_equals_reference(splits, mask, T, path, monkeypatch):
    """The CPU split-K path (chunks attended as separate work items, merged by log-sum-exp) on odd lengths, and in
    float32 the two that take its place by default (qada's streamed C kernel, else two BLAS products); each is the
    path taken."""
    import qada.attention.sdpa as sdpa
    from qada.attention.streamed import kernel_error

    if path == "streamed_attention" and kernel_error() is not None:
        pytest.skip(f"the streamed kernel cannot run here: {kernel_error()}")
    executor = EXECUTORS.build("sdpa", splits=splits, min_split=16, products=path == "products_attention",
                               streamed=path == "streamed_attention")
    taken = []
    for name in ("products_attention", "split_k_attention", "streamed_attention"):
        function = getattr(sdpa, name)
        monkeypatch.setattr(sdpa, name, lambda *a, _f=function, _n=name: taken.append(_n) or _f(*a))
    for b, H, H_kv in ((1, 9, 3), (2, 8, 2)):
        case = make_case(b, H, H_kv, T, 16, None, mask, torch.float32, seed=T + splits)
        check_against_reference(executor, case)
    assert set(taken) == {path}
    with pytest.raises(ValueError, match="expected splits to be an int >= 1"):
        EXECUTORS.build("sdpa", splits=0)
    for name in ("products", "streamed"):
        with pytest.raises(ValueError, match=f"expected {name} to be a bool"):
            EXECUTORS.build("sdpa", **{name: "yes"})


@pytest.mark.parametrize("mask", ["local", "dense", "mixed", "one_group_local"])
def test_sdpa_without_host_skip_never_syncs_and_equals_reference(mask, monkeypatch):
    """``host_skip=False`` (the default off the CPU): no nonzero/tolist/item, the same output."""
    executor = EXECUTORS.build("sdpa", host_skip=False)
    case = make_case(2, 8, 2, 300, 16, [0, 37], mask, torch.float32, seed=5)
    reference = EXECUTORS.build("reference")
    ref = decode_attention(reference, *case[:4], WINDOW, start=case[4])
    for name in ("nonzero", "tolist", "item", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host sync: {_n}"))
    got = decode_attention(executor, *case[:4], WINDOW, start=case[4])
    monkeypatch.undo()
    torch.testing.assert_close(got.output, ref.output, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.local, ref.local)


def buffer_step(ends, starts, local_kind, C=64, b=2, H=6, H_kv=3, d=16, seed=3):
    """A decode step on a preallocated buffer of ``C`` slots whose rows hold ``[start, end)``, with a decision."""
    from qada.attention import GroupDecision
    from qada.step import DecodeStep

    q, k, v, local, _ = make_case(b, H, H_kv, C, d, None, local_kind, torch.float32, seed=seed)
    start = None if starts is None else torch.tensor(starts)
    step = DecodeStep(q[:, :, 0], k, d**-0.5, WINDOW, start=start, end=torch.tensor(ends), values=v)
    read = ~local.view(b, H_kv, H // H_kv).all(-1)
    return step, GroupDecision(local, read)


@pytest.mark.parametrize("ends, starts", [([40, 27], [0, 6]), ([40, 40], None), ([40, 40], [0, 0]), ([33, 40], None)])
@pytest.mark.parametrize("local_kind", ["mixed", "one_group_local", "dense", "local"])
@pytest.mark.parametrize("splits", [None, 1, 2])
def test_sdpa_on_a_buffer_reads_the_host_once_and_equals_reference(ends, starts, local_kind, splits, monkeypatch):
    """The host-skipping path on a preallocated buffer (rows ending apart, left padding): one host read per call
    (:class:`~qada.attention.sdpa.HostPlan`), the reference's output; the mask of the keys attended is built only
    where the rows do not all hold ``[0, reach)``."""
    ref = EXECUTORS.build("reference").attend(*buffer_step(ends, starts, local_kind))[0]
    step, decision = buffer_step(ends, starts, local_kind)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    for name in ("nonzero", "item", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"another host read: {_n}"))
    got = EXECUTORS.build("sdpa", splits=splits, min_split=8).attend(step, decision)[0]
    monkeypatch.undo()
    assert len(reads) == 1
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    if len(set(ends)) == 1 and not any(starts or []):
        assert "real" not in step.__dict__  # every row holds [0, reach): no mask


def test_host_plan_says_which_groups_are_read_and_how_far_the_rows_reach():
    from qada.attention.sdpa import HostPlan

    step, (local, read) = buffer_step([40, 27], [0, 6], "one_group_local")
    plan = HostPlan.read(step, local, read)
    assert plan.pairs == [tuple(p) for p in read.nonzero().tolist()]
    assert plan.any_local and plan.reach == 40 and not plan.unmasked
    step, (local, read) = buffer_step([40, 40], [0, 0], "dense")
    plan = HostPlan.read(step, local, read)
    assert plan.pairs == [(r, g) for r in range(2) for g in range(3)] and not plan.any_local
    assert plan.reach == 40 and plan.unmasked
    assert not HostPlan.read(*buffer_step([40, 40], [0, 3], "dense")[:1], local, read).unmasked
    step = buffer_step([40, 40], None, "dense")[0]
    step.end = None  # a growing cache: the rows end at its length
    assert HostPlan.read(step, local, read).reach == step.length and HostPlan.read(step, local, read).unmasked
    step = buffer_step([40, 40], [0, 3], "dense")[0]
    step.end = None  # left padding on a growing cache: masked
    assert not HostPlan.read(step, local, read).unmasked
