"""The kernels a compiled layer step launches on a CUDA GPU, from Inductor's own output code made on the CPU
(``benchmarks/inductor_code.py``): the parsing and the launch comparison here; Inductor's code itself where torch is
its CUDA build (``bash scripts/gpu-versions.sh tests/test_inductor_code.py``; skipped on a CPU build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from benchmarks.inductor_code import _constant, compare_launches, forward_kernels, kernels
from tests.triton_launches import fused_step_launches

ROOT = Path(__file__).resolve().parent.parent

WRAPPER = textwrap.dedent(
    '''
    split_kernel_0 = async_compile.triton('qada_split', """
    @triton_heuristics.user_autotune(
        configs=[{'num_warps': 4, 'num_stages': 2}],
    )
    @triton.jit
    def qada_split(Q, OUT, n, scale):
        pass
    """, device_str='cuda')
    triton_poi_fused_add_1 = async_compile.triton('triton_poi_fused_add_1', """
    @triton_heuristics.pointwise(size_hints={'x': 8})
    @triton.jit
    def triton_poi_fused_add_1(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
        pass
    """, device_str='cuda')
    class Runner:
        def call(self, args):
            arg0_1, arg1_1 = args
            args.clear()
            with torch.cuda._DeviceGuard(0):
                buf0 = empty_strided_cuda((2, 4), (4, 1), torch.float32)
                # Topologically Sorted Source Nodes: [x]
                split_kernel_0.run(reinterpret_tensor(arg0_1, (2, 4), (8, 1), 4), buf0, 7, 0.1, 2, 1, 1, stream=stream0)
                triton_poi_fused_add_1.run(buf0, arg1_1, 8, stream=stream0)
                extern_kernels.bmm(arg1_1, arg1_1, out=buf1)
                buf2 = torch.ops.aten.topk.default(buf1, 2)
            return (buf0, )
    '''
)


def test_kernels_reads_the_call_body_in_order():
    """Launches of user-defined kernels (by their function name), Inductor's own kernels, external calls and aten
    fallbacks, in the order ``call`` makes them; a launch keeps its argument expressions."""
    found = kernels(WRAPPER)
    assert [(k["kind"], k["name"]) for k in found] == [
        ("launch", "qada_split"), ("inductor", "triton_poi_fused_add_1"), ("extern", "bmm"),
        ("fallback", "aten.topk")]  # fmt: skip
    assert found[0]["args"] == ["reinterpret_tensor(arg0_1, (2, 4), (8, 1), 4)", "buf0", "7", "0.1", "2", "1", "1"]


FORWARD_WRAPPER = textwrap.dedent(
    """
    class Runner:
        def call(self, args):
            arg0_1, arg1_1 = args
            with torch.cuda._DeviceGuard(0):
                triton_poi_fused_mask_0.run(arg0_1, buf0, 8, stream=stream0)
                buf1 = torch.ops.qada.decode_buffer.default(arg1_1, arg0_1, arg0_1, buf0, buf2, 0, 0, 0.125)
                assert_size_stride(buf1, (1, 9, 1, 64), (576, 64, 64, 1), 'torch.ops.qada.decode_buffer.default')
                assert_alignment(buf1, 16, 'torch.ops.qada.decode_buffer.default')
                extern_kernels.mm(buf1, arg0_1, out=buf3)
                buf4 = torch.ops.qada.decode_buffer.default(buf3, arg0_1, arg0_1, None, None, 0, 1, 0.125)
                buf5 = torch.ops.qada.decode_buffer.default(buf4, arg0_1, arg0_1, buf0, buf2, 0, 2, 0.125)
                buf6 = torch.ops.qada.decode_buffer.default(buf5, arg0_1, arg0_1, buf7, buf2, 0, 3, 0.125)
            return (buf6, )
    """
)


def test_forward_kernels_counts_what_each_qada_call_runs():
    """A whole step's kernels: Inductor's and the external ones in the graph (its checks of a fallback's output are
    not kernels), each ``qada::decode_buffer`` call's layer step, and the rows' bounds where a call derives them:
    given a mask or positions other than the last deriving call's (not given: reused)."""
    found = kernels(FORWARD_WRAPPER)
    assert [k["kind"] for k in found] == ["inductor", "fallback", "extern", "fallback", "fallback", "fallback"]
    assert found[3]["args"][3:5] == ["None", "None"]
    assert forward_kernels(FORWARD_WRAPPER, 3, 5) == {"graph": 2, "calls": 4, "deriving": 2,
                                                      "total": 2 + 4 * 3 + 2 * 5}


def test_constants_as_the_wrapper_writes_them():
    assert _constant("-inf") == float("-inf") and _constant("float('inf')") == float("inf")
    assert _constant("0.25") == 0.25 and _constant("-3") == -3


def _launch_pair():
    """An eager launch on ``args`` and the compiled launch the wrapper above writes for it."""
    query = torch.zeros(2, 8)
    scale = torch.zeros(2, 4)  # an input the kernel does not see
    out = torch.empty(2, 4)
    eager = [{"name": "qada_split", "grid": (2,), "args": [query.view(2, 2, 4)[:, 1], out, 7, 0.1]}]
    compiled = [{"name": "qada_split", "args": ["reinterpret_tensor(arg0_1, (2, 4), (8, 1), 4)", "buf0", "7",
                                                "0.1", "2", "1", "1"]}]  # fmt: skip
    return eager, compiled, (query, scale)


def test_compare_launches_accepts_the_same_launch():
    """Same kernel and grid; the view of an input with the same shape, strides and offset; a new buffer; the same
    integer; a float equal once rounded to float32 (Inductor writes the fp64 value)."""
    eager, compiled, args = _launch_pair()
    assert compare_launches(eager, compiled, args) == []
    compiled[0]["args"][3] = "0.10000000000000000555"
    assert compare_launches(eager, compiled, args) == []


@pytest.mark.parametrize("change, expected", [
    (lambda c: c["args"].__setitem__(0, "reinterpret_tensor(arg0_1, (2, 4), (8, 1), 0)"), "view"),  # offset
    (lambda c: c["args"].__setitem__(1, "arg0_1"), "new buffer"),  # an input where eager has a new buffer
    (lambda c: c["args"].__setitem__(2, "8"), "7 (eager) vs 8"),
    (lambda c: c["args"].__setitem__(3, "0.2"), "0.1 (eager) vs 0.2"),
    (lambda c: c["args"].__setitem__(4, "3"), "grid"),
    (lambda c: c.__setitem__("name", "qada_other"), "launches"),
    (lambda c: c.__setitem__("args", c["args"][:3]), "arguments"),  # an argument missing
])  # fmt: skip
def test_compare_launches_names_each_difference(change, expected):
    eager, compiled, args = _launch_pair()
    change(compiled[0])
    problems = compare_launches(eager, compiled, args)
    assert problems and any(expected in problem for problem in problems), problems


def test_compare_launches_maps_each_tensor_to_one_name():
    """The same eager tensor passed as two names, or two eager tensors as one name, is a difference."""
    query, out, other = torch.zeros(2, 4), torch.empty(2, 4), torch.empty(2, 4)
    eager = [{"name": "k", "grid": (1,), "args": [query, out]}, {"name": "k", "grid": (1,), "args": [query, other]}]
    same = [{"name": "k", "args": ["arg0_1", "buf0", "1", "1", "1"]},
            {"name": "k", "args": ["arg0_1", "buf1", "1", "1", "1"]}]
    assert compare_launches(eager, same, (query,)) == []
    merged = [same[0], {"name": "k", "args": ["arg0_1", "buf0", "1", "1", "1"]}]  # other and out as one buffer
    assert any("buf0" in problem for problem in compare_launches(eager, merged, (query,)))


CASES = {  # name: (moment source, criterion, executor options)
    "qada": ("stored", {"name": "qada", "tau": 0.3}, {}),
    "qada decide_once": ("stored", {"name": "qada", "tau": 0.3}, {"decide_once": True}),
    "qada current": ("current", {"name": "qada", "tau": 0.3}, {}),
    "qada estimating": ("stored", {"name": "qada", "tau": 0.3}, {"estimate_in_splits": True}),
    "qada estimating current": ("current", {"name": "qada", "tau": 0.3}, {"estimate_in_splits": True}),
    "qada_tail": ("stored", {"name": "qada_tail", "tau": 0.3}, {}),
    "qada_tail pages spread": ("stored", {"name": "qada_tail", "tau": 0.3},
                               {"decide_once": True, "pages_per_program": 1}),
    "qada_tail_budget": ("stored", {"name": "qada_tail_budget", "sparsity": 0.5}, {}),
    "qada_budget": ("stored", {"name": "qada_budget", "sparsity": 0.5, "per_group": True}, {}),
}  # fmt: skip

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch
    from torch.utils._pytree import tree_flatten
    from benchmarks.compile_trace import capture_layer_step
    from benchmarks.inductor_code import (compiled_as_launched, inductor_code, launches_over_calls, measure,
                                          pretend_cuda_device)
    pretend_cuda_device()
    from tiny_models import tiny_model
    from qada.models import build_run
    from qada.moments import StoredMoments
    from qada.moments.reference import collect_reference_keys

    model = tiny_model("llama")  # the model of tests/test_fused_decision.py's GPU tests, two rows as there
    reference = collect_reference_keys(model, torch.randint(1, 128, (1, 64), generator=torch.Generator()
                                       .manual_seed(7)), chunk_size=16)
    def two_rows(length, seed):
        ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        return ids, mask

    ids, mask = two_rows(20, 3)
    longer = two_rows(37, 4)  # a second cache size: compiled once more, sizes symbolic
    rows = {{}}
    for index, (name, (source, criterion, executor)) in enumerate(json.loads({cases!r}).items()):
        if source == "stored":
            source = StoredMoments(offset=12, min_bulk_keys=4)
            source.set_reference(reference)
        run = build_run(criterion=criterion, moments=source, executor={{"name": "triton_fused", "block_size": 16,
                        **executor}}, window={{"t_local": 8, "t_sink": 2}}, compile=True)
        rows[name] = measure(model, run, ids, mask, longer)
        step, _ = capture_layer_step(model, run, ids, mask)  # the code against every call of an eager decode
        calls = torch.load(f"{calls}/{{index}}.pt")
        codes = inductor_code(step, calls[0], calls[-1])  # made once for both comparisons below
        rows[name]["over_calls"] = launches_over_calls(step, calls, codes)
        rows[name]["over_calls"]["at_an_offset"] = sum(  # tensor arguments that are views at a storage offset
            isinstance(t, torch.Tensor) and t.storage_offset() > 0 for args in calls for t in tree_flatten(args)[0])
        rows[name]["compiled_as_launched"] = compiled_as_launched(step, calls, codes[0])
    print("ROWS" + json.dumps(rows))
    """
)

RECORD = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch
    from tiny_models import tiny_model
    from qada.moments.reference import collect_reference_keys
    from tests.step_replay import recording_layer_steps
    from tests.test_fused_decision import greedy, make_run

    model = tiny_model("llama")  # with the reference and the runs of the GPU tests in tests/test_fused_decision.py
    keys = collect_reference_keys(model, torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(7)),
                                  chunk_size=16)
    for index, (name, (source, criterion, executor)) in enumerate(json.loads({cases!r}).items()):
        run = make_run(source, {{"name": "triton_fused", "block_size": 16, **executor}}, keys, criterion,
                       compile=False)
        with recording_layer_steps() as calls, torch.no_grad():
            greedy(model, run, "static")  # the decode of the GPU tests: 6 steps, two rows (one left-padded)
        torch.save([args for _, _, args in calls], f"{calls}/{{index}}.pt")
    """
)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The rows of :data:`SCRIPT` for :data:`CASES`, the layer-step calls of each case's eager decode recorded first
    (:data:`RECORD`, in Triton's interpreter: the kernels run; Inductor's code is made without it)."""
    import triton.backends

    if torch.version.cuda is None:
        pytest.skip("Inductor's CUDA code needs torch's CUDA build (bash scripts/gpu-versions.sh runs this)")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend")
    calls = tmp_path_factory.mktemp("calls")
    where = dict(root=str(ROOT), tests=str(ROOT / "tests"), cases=json.dumps(CASES), calls=str(calls))
    recorded = subprocess.run([sys.executable, "-c", RECORD.format(**where)], capture_output=True, text=True,
                              timeout=900, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert recorded.returncode == 0, recorded.stderr[-4000:]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(**where)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("ROWS", 1)[1])


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_fused_step_launches_what_the_eager_step_launches(measured, case):
    """Inductor's code for the compiled ``triton_fused`` step (``compile_step=True``) launches the step's kernels
    and nothing else (no kernel of its own, no external call, no fallback: a 0-d ``torch.empty`` once became a
    fill kernel), each launch exactly the eager step's: the same kernel, grid, tensors and values; compiled once
    more at a second cache size (symbolic sizes), the same kernels."""
    source, criterion, executor = CASES[case]
    row = measured[case]
    expected = fused_step_launches(source, criterion["name"], executor.get("decide_once", False),
                                   executor.get("estimate_in_splits", False))
    assert [k["name"] for k in row["kernels"]] == expected
    assert (row["inductor"], row["extern"], row["fallback"]) == (0, 0, 0)
    assert row["differences"] == []
    assert row["kernels_symbolic"] == row["kernels"]


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_fused_step_launches_what_eager_launches_at_every_call_of_a_decode(measured, case):
    """The code compiled on the first layer-step call of a decode (6 steps, 2 layers: 12 calls, each layer's states
    and stored reference its own, one at a storage offset) launches, at every call, what the eager step launches
    there: the same kernels, tensors and values; compiled on the last call, the same code. So one compiled step
    serves every layer and step as the eager step would (what the code does on a GPU beyond its launches, e.g.
    how its kernels are compiled, is not seen here)."""
    over = measured[case]["over_calls"]
    assert over["calls"] == 12
    assert over["at_an_offset"] > 0 or CASES[case][0] != "stored"  # (a layer's stored-moment state: a view)
    assert over["differences"] == {}
    assert over["same_code_at_last_call"]


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_fused_step_compiles_each_kernel_as_triton_launches_it_at_every_call(measured, case):
    """At every call of the decode, each kernel of the compiled step is compiled as Triton's launcher compiles it
    for the eager launch there: the same constants (ints equal to 1), the same divisibility by 16 of every pointer
    and int, the same warps and stages; and compiled with Inductor's options (floats as fp64 parameters,
    ``debug=True``, ``sanitize_overflow=False``) its PTX is the launcher's instruction for instruction (registers,
    register moves and the parameters' conversions aside). So a compiled step that decides otherwise than the eager
    one on a GPU (an H200, 2026-11-27) does so for a reason that is not in how its kernels are compiled or
    launched."""
    row = measured[case]["compiled_as_launched"]
    assert row["specialization"] == []
    assert row["ptx"] and all(row["ptx"].values()), row["ptx"]


FAKE_CUDA_PREAMBLE = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch
    from benchmarks.inductor_code import bounds_operations, forward_code, forward_kernels, measure, pretend_cuda_device
    pretend_cuda_device()
    from tiny_models import tiny_model
    from qada.models import build_run
    from qada.moments import StoredMoments
    from qada.moments.reference import collect_reference_keys

    model = tiny_model("llama")
    reference = collect_reference_keys(model, torch.randint(1, 128, (1, 64), generator=torch.Generator()
                                       .manual_seed(7)), chunk_size=16)
    ids = torch.randint(0, 128, (2, {length}), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    """
)
"""The start of a script run by :func:`rows_on_fake_cuda`: a pretended CUDA device, the tiny model, its stored reference
and two rows of ``length`` tokens (the second left-padded)."""


def rows_on_fake_cuda(script: str, length: int) -> dict:
    """The ``ROWS`` JSON that :data:`FAKE_CUDA_PREAMBLE` (rows of ``length`` tokens) then ``script`` print, run in a
    process of its own without Triton's interpreter; skips without torch's CUDA build or Triton's nvidia backend."""
    import triton.backends

    if torch.version.cuda is None:
        pytest.skip("Inductor's CUDA code needs torch's CUDA build (bash scripts/gpu-versions.sh runs this)")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend")
    code = FAKE_CUDA_PREAMBLE.format(root=str(ROOT), tests=str(ROOT / "tests"), length=length) + script
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("ROWS", 1)[1])


FORWARD_SCRIPT = textwrap.dedent(
    """
    source = StoredMoments(offset=12, min_bulk_keys=4)
    source.set_reference(reference)
    run = build_run(criterion={"name": "qada", "tau": 0.3}, moments=source,
                    executor={"name": "triton_fused", "block_size": 16}, window={"t_local": 8, "t_sink": 2},
                    compile=True)
    derive = bounds_operations(*ids.shape)
    steps = {name: forward_kernels(forward_code(model, r, ids, mask), 3, derive)
             for name, r in (("dense", None), ("qada fused", run))}
    print("ROWS" + json.dumps(dict(steps, layers=model.config.num_hidden_layers, derive=derive)))
    """
)


def test_a_compiled_decode_step_derives_the_rows_bounds_once():
    """``torch.compile(model.forward)`` of a fused qada decode step on (fake) CUDA: one ``qada::decode_buffer`` call
    per layer, only the first given the mask and positions (Inductor copied them for every call, and every layer
    derived the bounds again: ~6 kernels per layer), and nothing of the dense attention left in the graph."""
    rows = rows_on_fake_cuda(FORWARD_SCRIPT, 20)
    dense, fused = rows["dense"], rows["qada fused"]
    assert dense["calls"] == 0 and fused["calls"] == rows["layers"] == 2
    assert fused["deriving"] == 1 and rows["derive"] >= 3
    assert fused["graph"] < dense["graph"]


UNFUSED_SCRIPT = textwrap.dedent(
    """
    rows = {}
    for name, criterion in (("qada", {"name": "qada", "tau": 0.3}), ("qada_tail", {"name": "qada_tail", "tau": 0.3,
                                                                                  "page_size": 4})):
        source = StoredMoments(offset=12, min_bulk_keys=4)
        source.set_reference(reference)
        run = build_run(criterion=criterion, moments=source, executor={"name": "triton", "block_size": 16},
                        window={"t_local": 8, "t_sink": 2}, compile=True)
        rows[name] = measure(model, run, ids, mask)
    print("ROWS" + json.dumps(rows))
    """
)


def test_the_compiled_torch_step_on_cuda_makes_its_few_row_products_loops():
    """The layer step compiled for a CUDA GPU with a criterion the kernels do not decide (here on ``triton``): its
    window scores, heavy keys and page bounds (a KV group's few query heads against keys) are reductions in
    Inductor's own kernels (:func:`~qada.models.step_compile.gpu_step_options`), not a cuBLAS launch each; the stored
    source's step is its one launch (``moment_launch``), first, where Inductor made several kernels of it."""
    rows = rows_on_fake_cuda(UNFUSED_SCRIPT, 40)
    for name, row in rows.items():
        assert row["extern"] == 0, (name, row["kernels"])
        assert row["inductor"] > 0
        launches = [k["name"] for k in row["kernels"] if k["kind"] == "launch"]
        assert launches == ["stored_moment_step_kernel"] == [row["kernels"][0]["name"]], (name, row["kernels"])


DENSE_SCRIPT = textwrap.dedent(
    """
    run = build_run(criterion="dense", moments="none", executor={"name": "triton", "block_size": 16},
                    window={"t_local": 8, "t_sink": 2}, compile=True)
    longer_ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(4))
    longer_mask = torch.ones_like(longer_ids)
    longer_mask[1, :5] = 0
    print("ROWS" + json.dumps({"qada dense": measure(model, run, ids, mask, (longer_ids, longer_mask))}))
    """
)


def test_the_dense_criterion_on_triton_launches_the_executor_alone():
    """qada's all-dense path (the ``dense`` criterion on ``triton``, :mod:`qada.models.dense_step`) compiled for a
    CUDA GPU: the split and the combine, each the eager step's launch, no kernel of Inductor's (the general layer
    step ran eight before them: the decision, the group policy, the statistics, the window gather), the same at a
    second cache size."""
    row = rows_on_fake_cuda(DENSE_SCRIPT, 20)["qada dense"]
    assert [k["name"] for k in row["kernels"]] == ["qada_decode_split_kernel", "qada_decode_combine_kernel"]
    assert (row["inductor"], row["extern"], row["fallback"], row["executor_launches"]) == (0, 0, 0, 0)
    assert row["per_layer"] == 2 and row["differences"] == []
    assert row["kernels_symbolic"] == row["kernels"]
