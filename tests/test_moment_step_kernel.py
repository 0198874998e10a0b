"""The moment step's kernel (:mod:`qada.attention.moment_step`, chosen by
:func:`~qada.models.fused_step.fused_moment_step`) against the sources' own torch steps: the same
float64 state and float32 moments after every step, over rows with left padding, head dims that are not a power of
two, steps that add keys and steps where the stored range jumps. On CPU it runs in Triton's interpreter."""

from __future__ import annotations

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
@pytest.mark.parametrize("d", [16, 24])
def test_kernel_step_equals_the_source_step(kind, d):
    """Every state tensor and both moments, after each of 12 steps: equal to float64 rounding (the float32
    moments to their last bit). Row 1 (start 5) reaches the stored source's short-prompt switch: its range jumps."""
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
    """Both kernels lower to PTX for sm_90 (no GPU needed): what runs on an H100."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from qada.attention import _moment_kernel as K
        pointers = {"COUNT": "*fp64", "MEAN": "*fp64", "M2": "*fp64", "OUT_MEAN": "*fp32", "OUT_COV": "*fp32",
                    "KEYS": "*bf16", "START": "*i64", "END": "*i64", "S1": "*fp64", "S2": "*fp64", "OLD_END": "*i64",
                    "JUMP_N": "*i64", "JUMP_COUNT": "*fp64", "JUMP_S1": "*fp64", "JUMP_S2": "*fp64", "COV": "*fp32",
                    "REF": "*fp32", "SHIFT": "*fp64"}
        constants = {"D": 128, "BLOCK_R": 16, "BLOCK_D": 128, "HAS_START": True}
        for kernel in (K.current_moment_step_kernel, K.stored_moment_step_kernel):
            names = kernel.arg_names
            kinds = dict(pointers, MEAN="*fp64" if "M2" in names else "*fp32")
            signature = {n: kinds.get(n, "constexpr" if n in constants else "i32") for n in names}
            source = ASTSource(kernel, signature, constexprs={(names.index(n),): c for n, c in constants.items()})
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
