"""The kernels a compiled layer step launches on a CUDA GPU, read from Inductor's own output code, made on the CPU.

    bash scripts/gpu-versions.sh --python benchmarks/inductor_code.py      # SmolLM2, 2 rows, a 256-token prompt
    bash scripts/gpu-versions.sh --python benchmarks/inductor_code.py --configs "qada fused" --out /tmp/code

Needs torch's CUDA build (it makes fake CUDA tensors; the CPU build cannot), no GPU: ``scripts/gpu-versions.sh``
builds an environment with the GPU machines' versions. The embedded model prefills eagerly on the CPU; the first
decode step's layer step is then compiled by ``torch.compile`` (Inductor, as a run with ``compile=True`` does) on
fake CUDA copies of its arguments (shapes, strides and storage offsets kept) for a pretended sm_90 device with 132
SMs. Inductor lowers, schedules and writes its wrapper code; the code is taken when Inductor would load it (its
kernels compiled and run: that needs the GPU), so nothing runs. Two of Inductor's passes need a device and are off:
constant folding of uniform values and the padding of matrix products. On a GPU they may add or remove kernels of
the unfused (``triton`` executor) steps; neither changes a Triton launch.

Per configuration it reports the step's kernels: the user-defined Triton launches (qada's kernels), the kernels
Inductor generates (each fused torch operation group is one), and the calls to external kernels (cuBLAS products).
For the ``triton_fused`` executor it also checks that each launch of the compiled step is the eager step's launch:
the same kernel, every argument the same tensor (the same input, or a view of it with the same shape, strides and
offset; the same new buffer) or the same value (a float compared after rounding to float32: Inductor passes
Python floats as fp64 and the kernels cast them). The ``triton`` executor's step launches its two kernels after
the compiled part (eagerly, inside the model's CUDA graph), so its row adds them to what Inductor writes.

Writes ``<out>/inductor-code-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS: dict[str, dict[str, Any]] = {  # name: build_run arguments (stored moments unless said)
    "qada dense": {"criterion": "dense", "moments": "none", "executor": {"name": "triton"}},
    "qada": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton"}},
    "qada_tail": {"criterion": {"name": "qada_tail", "tau": 0.3}, "executor": {"name": "triton"}},
    "qada_tail_budget": {"criterion": {"name": "qada_tail_budget", "sparsity": 0.85},
                         "executor": {"name": "triton"}},
    "qada fused": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton_fused"}},
    "qada fused (current moments)": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton_fused"},
                                    "moments": "current"},
    "qada fused once": {"criterion": {"name": "qada", "tau": 0.6},
                        "executor": {"name": "triton_fused", "decide_once": True}},
    "qada fused estimating": {"criterion": {"name": "qada", "tau": 0.6},
                              "executor": {"name": "triton_fused", "estimate_in_splits": True}},
    "qada_tail fused": {"criterion": {"name": "qada_tail", "tau": 0.3}, "executor": {"name": "triton_fused"}},
    "qada_tail fused (pages spread)": {"criterion": {"name": "qada_tail", "tau": 0.3},
                                      "executor": {"name": "triton_fused", "decide_once": True,
                                                   "pages_per_program": 1}},
    "qada_tail_budget fused": {"criterion": {"name": "qada_tail_budget", "sparsity": 0.85},
                               "executor": {"name": "triton_fused"}},
    "qada_budget fused": {"criterion": {"name": "qada_budget", "sparsity": 0.85}, "executor": {"name": "triton_fused"}},
}  # fmt: skip

FORWARD = ["dense", "qada dense", "qada", "qada fused", "qada_tail fused", "qada_tail_budget fused"]
"""The configurations whose whole compiled decode step :func:`main` counts by default (dense: the plain model)."""

EXECUTOR_LAUNCHES = {"triton": 2}  # launches an executor makes after an unfused step (split, combine)


class CodeTaken(Exception):
    """Raised where Inductor would load its output code (which compiles and runs the kernels): the code is taken."""


@contextlib.contextmanager
def taking_code() -> Iterator[list[str]]:
    """Within: Inductor's output code is taken where Inductor would load it (:class:`CodeTaken` stops the compile
    there), appended to the list yielded; on leaving, loading is restored and dynamo reset."""
    import torch
    import torch._inductor.codecache as codecache

    codes: list[str] = []
    load = codecache.PyCodeCache.load_by_key_path

    def take(key: str, path: str, *rest: Any, **kwargs: Any) -> Any:
        codes.append(Path(path).read_text())
        raise CodeTaken

    codecache.PyCodeCache.load_by_key_path = take
    try:
        yield codes
    finally:
        codecache.PyCodeCache.load_by_key_path = load
        torch._dynamo.reset()


def compile_until_taken(call: Any, codes: list[str], what: str) -> None:
    """``call()`` (a first call of a compiled function, inside :func:`taking_code`), stopped where its code is taken;
    an error if it wrote none into ``codes`` (``what``: the function, for the message)."""
    written = len(codes)
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the expected stop arrives wrapped by dynamo
        if len(codes) == written:
            raise RuntimeError(f"Inductor wrote no code for {what}") from error


def pretend_cuda_device(sms: int | None = None) -> None:
    """:func:`~benchmarks.compile_trace.pretend_cuda_triton`, and torch reports one sm_90 device with ``sms``
    multiprocessors (default an H100's, :data:`~benchmarks.kernel_resources.H100_SMS`) to Inductor and to qada (its
    split count); Inductor's passes that run operations on the device are off. Process-wide; irreversible. Needs
    torch's CUDA build (fake CUDA tensors)."""
    import types

    import torch
    from torch._inductor import config
    from torch._inductor.runtime import hints

    from benchmarks.compile_trace import pretend_cuda_triton
    from benchmarks.kernel_resources import H100_SMS

    sms = H100_SMS if sms is None else sms

    if torch.version.cuda is None:
        raise RuntimeError("Inductor's CUDA code needs torch's CUDA build (a CPU build cannot make fake CUDA "
                           "tensors): run this with scripts/gpu-versions.sh --python")
    pretend_cuda_triton()
    props = types.SimpleNamespace(
        name="pretended sm_90", major=9, minor=0, multi_processor_count=sms, regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32, total_memory=80 << 30,
        shared_memory_per_block_optin=232448, L2_cache_size=50 << 20, gcnArchName="")
    torch.cuda.get_device_properties = lambda *args, **kwargs: props
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    device = hints.DeviceProperties(type="cuda", index=0, multi_processor_count=sms, cc=90, major=9,
                                    regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                                    max_threads_per_block=1024, warp_size=32)
    hints.DeviceProperties.create = classmethod(lambda cls, _device: device)
    config.joint_graph_constant_folding = False  # (folds on the device)
    config.shape_padding = False  # (times padded products on the device)


def fake_cuda(args: Any) -> Any:
    """Fake CUDA copies of the tensors in ``args`` (any nesting), each a view of a storage as large as the real
    one's at the real storage offset (call inside a ``FakeTensorMode``)."""
    import torch
    from torch.utils._pytree import tree_map

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        base = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="cuda")
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    return tree_map(fake, args)


def inductor_code(step: Any, *arg_sets: tuple) -> list[str]:
    """The Python wrapper code Inductor writes for ``step`` (a run's :class:`~qada.models.layer_step.LayerStep`)
    compiled as a run with ``compile=True`` compiles it, on fake CUDA copies of each of ``arg_sets`` in turn (a first
    call's arguments, then those of a call at another cache size): one code per compile, the first with static
    shapes, the second with symbolic sizes (as a run that meets a second cache size recompiles). Call
    :func:`pretend_cuda_device` first."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qada.models.layer_step import compile_layer_step

    if step.fused is not None:
        step.fused.to_device(torch.device("cpu"))  # (its held tensors: made on the device by a run's prefill)
    # the function the run's step calls (layer_step, or the fused or dense step) with the components bound to it
    compiled = compile_layer_step(dict(step.eager.keywords), "inductor", step.eager.func)

    def first_call(args: tuple) -> None:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            compiled(*fake_cuda(args))

    with taking_code() as codes:
        for args in arg_sets:
            compile_until_taken(lambda args=args: first_call(args), codes, "the layer step")
    return codes


def call_body(code: str) -> list[str]:
    """The statements of the wrapper's ``call`` (the code run per step), one string each, comments dropped."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*def call\(self, args\):|def call\(args\):", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        if line.strip() and not line.strip().startswith("#"):
            body.append(line.strip())
    return body


def kernel_block(code: str, wrapper: str) -> str:
    """The source Inductor's code gives the kernel bound to ``wrapper`` (its decorators and body)."""
    return code.split(f"{wrapper} = async_compile.triton(", 1)[1].split("device_str=", 1)[0]


def user_kernels(code: str) -> dict[str, str]:
    """``{wrapper name: kernel function name}`` of the user-defined Triton kernels the code defines."""
    found = {}
    for wrapper, name in re.findall(r"^(\w+) = async_compile\.triton\('(\w+)', (?:'''|\"\"\")", code, re.M):
        if "user_autotune" in kernel_block(code, wrapper):
            found[wrapper] = name
    return found


def kernels(code: str) -> list[dict[str, Any]]:
    """The kernels ``call`` launches, in order: ``{"kind": "launch" (a user-defined Triton kernel: qada's) or
    "inductor" (a kernel Inductor generated) or "extern" (an external kernel, e.g. cuBLAS) or "fallback" (an aten
    operation Inductor could not lower), "name", "args" (a launch's argument expressions)}``."""
    users = user_kernels(code)
    found = []
    for statement in call_body(code):
        launch = re.match(r"(\w+)\.run\((.*)\)$", statement)
        if launch:
            wrapper = launch.group(1)
            kind = "launch" if wrapper in users else "inductor"
            call = ast.parse(statement).body[0].value
            found.append({"kind": kind, "name": users.get(wrapper, wrapper),
                          "args": [ast.unparse(arg) for arg in call.args]})
        elif m := re.search(r"\bextern_kernels\.(\w+)\(", statement):
            found.append({"kind": "extern", "name": m.group(1), "args": []})
        elif statement.startswith("assert_"):  # (Inductor's checks of a fallback's output name the operation)
            continue
        elif m := re.search(r"\btorch\.ops\.(\w+\.\w+)", statement):
            call = ast.parse(statement).body[0].value
            found.append({"kind": "fallback", "name": m.group(1),
                          "args": [ast.unparse(arg) for arg in call.args] if isinstance(call, ast.Call) else []})
    return found


def eager_launches(step: Any, args: tuple) -> list[dict[str, Any]]:
    """The launches of ``step`` (fused) run eagerly on ``args`` with no kernel run: ``{"name", "args": [value],
    "grid", "names": [parameter], "kernel", "options": {launch option: value}}``, each kernel's arguments bound by
    name and kept where Inductor passes them too (every parameter not declared ``tl.constexpr``, in order). The
    executors plan for the pretended device's SMs (:func:`pretend_cuda_device`), as the compiled step on its fake
    CUDA copies does, though ``args`` are CPU tensors (for which they count one SM)."""
    import torch

    from qada.attention import _triton_kernel, triton_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count  # (the pretended device's)

    found = []

    def record(kernel: Any, grid: tuple, *positional: Any, **keywords: Any) -> None:
        options = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # launch options, not arguments
        bound = kernel.signature.bind(*positional, **{k: v for k, v in keywords.items() if k not in options})
        bound.apply_defaults()
        constexprs = {kernel.arg_names[i] for i in kernel.constexprs}
        names = [name for name in bound.arguments if name in kernel.arg_names and name not in constexprs]
        found.append({"name": kernel.fn.__name__, "args": [bound.arguments[name] for name in names],
                      "grid": tuple(grid), "names": names, "kernel": kernel,
                      "options": {k: v for k, v in keywords.items() if k in options}})

    launch, count = _triton_kernel.run, triton_decode._num_sms
    _triton_kernel.run = record
    triton_decode._num_sms = lambda device: sms
    try:
        with torch.no_grad():
            step.eager(*args)  # (the fused or dense step: the run's step as it runs eagerly)
    finally:
        _triton_kernel.run, triton_decode._num_sms = launch, count
    return found


def compare_launches(eager: list[dict[str, Any]], compiled: list[dict[str, Any]], args: tuple) -> list[str]:
    """The differences between the ``eager`` launches (:func:`eager_launches`) and the ``compiled`` ones
    (:func:`kernels`' launches) of one step whose arguments were ``args``: ``[]`` when each compiled launch is the
    eager one (kernel, grid, arguments). Tensors are matched by what they are, not by name: each input of the step
    (by storage) must map to one ``argN_1`` of the code and back, each new buffer to one ``bufN``, and a view must
    have the same shape, strides and offset."""
    import numpy as np
    import torch
    from torch.utils._pytree import tree_flatten

    inputs = {t.untyped_storage().data_ptr(): t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
    problems: list[str] = []
    if [x["name"] for x in eager] != [x["name"] for x in compiled]:
        return [f"launches {[x['name'] for x in eager]} (eager) vs {[x['name'] for x in compiled]} (compiled)"]
    mapping: dict[str, str] = {}  # eager tensor's storage -> code name, and code name -> storage

    def bind(left: str, right: str, where: str) -> None:
        for a, b in ((left, right), (right, left)):
            if mapping.setdefault(a, b) != b:
                problems.append(f"{where}: {a} is {b} here but {mapping[a]} before")

    for e, c in zip(eager, compiled, strict=True):
        if len(c["args"]) < len(e["args"]):
            problems.append(f"{e['name']}: {len(e['args'])} arguments (eager) vs {len(c['args'])} with the grid "
                            "(compiled)")
            continue
        tail = c["args"][len(e["args"]):]
        grid = tuple(int(x) for x in tail) if all(x.lstrip("-").isdigit() for x in tail) else tail
        padded = tuple(e["grid"]) + (1,) * (len(grid) - len(e["grid"])) if isinstance(grid, tuple) else e["grid"]
        if grid != padded:
            problems.append(f"{e['name']}: grid {e['grid']} (eager) vs {tail} (compiled)")
        for position, (value, expression) in enumerate(zip(e["args"], c["args"], strict=False)):
            where = f"{e['name']} argument {position}"
            node = ast.parse(expression, mode="eval").body
            if isinstance(value, torch.Tensor):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "reinterpret_tensor":
                    name, size, stride, offset = (ast.literal_eval(a) if i else ast.unparse(a)
                                                  for i, a in enumerate(node.args))  # fmt: skip
                    view = (tuple(size), tuple(stride), offset)
                elif isinstance(node, ast.Name):
                    name, view = node.id, None
                else:
                    problems.append(f"{where}: a tensor (eager) vs {expression} (compiled)")
                    continue
                storage = value.untyped_storage().data_ptr()
                base = inputs.get(storage)
                key = f"input@{storage}" if base is not None else f"new@{storage}"
                bind(key, name, where)
                kind_ok = name.startswith("arg") == (base is not None)
                if not kind_ok:
                    problems.append(f"{where}: {'an input' if base is not None else 'a new buffer'} (eager) vs "
                                    f"{name} (compiled)")
                if view is not None:
                    offset = value.storage_offset() - (base.storage_offset() if base is not None else 0)
                    if view != (tuple(value.shape), tuple(value.stride()), offset):
                        problems.append(f"{where}: view {tuple(value.shape)} {value.stride()} +{offset} (eager) vs "
                                        f"{expression} (compiled)")
                elif base is not None and (value.shape, value.stride(), value.storage_offset()) != \
                        (base.shape, base.stride(), base.storage_offset()):  # fmt: skip
                    problems.append(f"{where}: a view of an input (eager) vs the input {name} (compiled)")
            else:
                try:
                    compiled_value = _constant(expression)
                except ValueError:
                    problems.append(f"{where}: {value!r} (eager) vs {expression} (compiled)")
                    continue
                same = (np.float32(value) == np.float32(compiled_value) if isinstance(value, float)
                        else value == compiled_value)  # fmt: skip
                if not same:
                    problems.append(f"{where}: {value!r} (eager) vs {compiled_value!r} (compiled)")
    return problems


def _constant(expression: str) -> Any:
    """The value of a constant argument as the wrapper code writes it (a literal, or ``inf``/``-inf``/``nan``,
    which it writes as names)."""
    text = expression.replace(" ", "")
    for name in ("inf", "nan"):
        for quoted in (f"float('{name}')", f'float("{name}")', f"math.{name}"):
            text = text.replace(quoted, name)
    if text.lstrip("+-") in ("inf", "nan"):
        return float(text)
    return ast.literal_eval(text)


TRITON_LAUNCH_DEFAULTS = {"num_warps": 4, "num_stages": 3, "maxnreg": None}
"""The launch options Triton uses where a launch (or Inductor's ``triton.Config({})``) names none (``maxnreg``: no
register cap; Inductor drops a launch's, so a capped launch shows as a difference)."""


def triton_metas(code: str) -> dict[str, dict[str, Any]]:
    """``{kernel function name: {"signature", "constants", "divisible": {parameter}, "num_warps", "num_stages",
    "maxnreg"}}``: how Inductor's code compiles each user-defined Triton kernel (its ``triton_meta`` and launch
    configuration; Triton's defaults, 4 warps, 3 stages and no register cap, where it lists none)."""
    found = {}
    for wrapper, name in user_kernels(code).items():
        block = kernel_block(code, wrapper)
        meta = re.search(r"triton_meta=(\{.*?\}),\s*\n", block, re.S)
        configs = re.search(r"configs=\[(.*?)\],\s*\n", block, re.S)
        if meta is None or configs is None:
            raise ValueError(f"no triton_meta or configs for {name} in Inductor's code")
        meta = ast.literal_eval(re.sub(r"DeviceProperties\(.*?\)", "None", meta.group(1)))
        config = ast.literal_eval(configs.group(1)) if configs.group(1).strip() else {}
        parameters = list(meta["signature"])
        found[name] = {"signature": meta["signature"], "constants": meta["constants"],
                       "divisible": {parameters[i[0]] for i in meta["configs"][0]},
                       "attrs": meta["configs"][0],
                       **{key: config.get(key, default) for key, default in TRITON_LAUNCH_DEFAULTS.items()}}
    return found


def jit_specialization(value: Any) -> str:
    """How Triton's launcher specialises one argument (Triton 3.x): ``"1"`` for an int equal to 1 (a constant),
    ``"D"`` for a pointer or an int divisible by 16 (``tt.divisibility``), ``""`` otherwise; ``"-"`` for floats and
    bools (never specialised)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "D" if value.data_ptr() % 16 == 0 else ""
    if isinstance(value, int) and not isinstance(value, bool):
        return "1" if value == 1 else "D" if value % 16 == 0 else ""
    return "-"


def specialization_over_calls(step: Any, calls: list[tuple], code: str,
                              metas: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Where ``code`` (Inductor's, for ``step`` compiled on ``calls[0]``) compiles a kernel otherwise than Triton's
    launcher would for the eager launch at some call: a parameter Inductor takes as a constant that the launch
    passes another value, or divisible by 16 (``tt.divisibility``) where the launch's is not, or the reverse; and
    launch options (warps, stages, register cap) that differ. ``[]``: every launch of every call runs a kernel
    compiled as Triton's launcher compiles it. ``metas``: :func:`triton_metas` of ``code``, where already read."""
    metas = triton_metas(code) if metas is None else metas
    found = []
    for index, args in enumerate(calls):
        for launch in eager_launches(step, args):
            meta = metas.get(launch["name"])
            if meta is None:
                found.append(f"call {index}: {launch['name']} is not among the code's kernels")
                continue
            where = f"call {index} {launch['name']}"
            for key, default in TRITON_LAUNCH_DEFAULTS.items():
                if launch["options"].get(key, default) != meta[key]:
                    found.append(f"{where}: {key} {launch['options'].get(key, default)} eagerly, {meta[key]} compiled")
            for name, value in zip(launch["names"], launch["args"], strict=True):
                spec = jit_specialization(value)
                if name in meta["constants"]:
                    if spec != "1" or meta["constants"][name] != 1:
                        found.append(f"{where}: {name} = {value!r} eagerly, the constant {meta['constants'][name]!r}"
                                     " compiled")
                elif spec == "1":
                    found.append(f"{where}: {name} = 1 eagerly (a constant), a run-time value compiled")
                elif spec != "-" and (spec == "D") != (name in meta["divisible"]):
                    found.append(f"{where}: {name} {'divisible' if spec == 'D' else 'not divisible'} by 16 eagerly, "
                                 f"{'' if name in meta['divisible'] else 'not '}compiled so")
    return found


def ptx_operations(kernel: Any, meta: dict[str, Any], inductor: bool) -> list[str]:
    """The PTX instructions (opcodes, in order) of ``kernel`` compiled for sm_90 with ``meta``
    (:func:`triton_metas`' entry): as Inductor compiles it (its signature, floats as fp64, ``debug=True``,
    ``sanitize_overflow=False``) or as Triton's launcher does (floats as fp32, the defaults); the loads of the
    parameters, the conversions of fp64 ones and register moves (``mov``, which the fp64 parameters shift about: a
    moment kernel running page-top programs had one more, elsewhere) left out."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(meta["signature"])
    options = {"num_warps": meta["num_warps"], "num_stages": meta["num_stages"]}
    if inductor:
        options.update(debug=True, sanitize_overflow=False)
    else:
        signature = {name: "fp32" if kind == "fp64" else kind for name, kind in signature.items()}
    compiled = triton.compile(ASTSource(kernel, signature, meta["constants"], meta["attrs"]),
                              target=GPUTarget("cuda", 90, 32), options=options)
    found = []
    for line in compiled.asm["ptx"].splitlines():
        line = line.strip()
        if not line or line.startswith(("//", ".", "$", "{", "}")) or "param" in line or "cvt.rn.f32.f64" in line:
            continue
        words = line.split()
        operation = words[1] if words[0].startswith("@") else words[0]
        if not operation.startswith("mov."):
            found.append(operation)
    return found


def compiled_as_launched(step: Any, calls: list[tuple], code: str | None = None) -> dict[str, Any]:
    """Whether Inductor's code for ``step`` (fused), compiled on ``calls[0]`` (``code``, where already made), runs at
    every call the kernels Triton's launcher runs there: ``{"specialization": [differences]
    (:func:`specialization_over_calls`), "ptx": {kernel: whether its PTX instructions are the same compiled both ways
    (:func:`ptx_operations`)}}``."""
    code = inductor_code(step, calls[0])[0] if code is None else code
    metas = triton_metas(code)
    kernels_by_name = {launch["name"]: launch["kernel"] for launch in eager_launches(step, calls[0])}
    return {"specialization": specialization_over_calls(step, calls, code, metas),
            "ptx": {name: ptx_operations(kernels_by_name[name], meta, True)
                    == ptx_operations(kernels_by_name[name], meta, False) for name, meta in metas.items()}}


def launches_over_calls(step: Any, calls: list[tuple], codes: list[str] | None = None) -> dict[str, Any]:
    """Inductor's code for ``step`` (fused) compiled on the first of ``calls`` (the arguments of every layer-step call
    of a decode, in order, e.g. recorded by an eager decode in Triton's interpreter), its launches against the eager
    launches of each call, as one compiled step serves every layer and step: ``{"calls": n, "differences": {call
    index: what differs}}`` (``{}``: every call launches what the code launches, values included), and
    ``"same_code_at_last_call"``: whether the code compiled on the last call is the first one's (the graph's own
    identifiers aside). ``codes``: :func:`inductor_code` of ``step`` on ``calls[0]`` and ``calls[-1]``, where already
    made."""
    codes = inductor_code(step, calls[0], calls[-1]) if codes is None else codes
    launches = [k for k in kernels(codes[0]) if k["kind"] == "launch"]
    differences = {}
    for index, args in enumerate(calls):
        found = compare_launches(eager_launches(step, args), launches, args)
        if found:
            differences[str(index)] = found
    unnamed = [re.sub(r"^# AOT ID: .*$", "", code, flags=re.M) for code in codes]
    return {"calls": len(calls), "differences": differences, "same_code_at_last_call": unnamed[0] == unnamed[1]}


def forward_code(model: Any, run: Any | None, ids: Any, mask: Any) -> str:
    """Inductor's wrapper code for ``torch.compile(model.forward, fullgraph=True)`` of the first decode step after an
    eager prefill of ``ids [b, T]`` (``mask``) into a static cache, with ``run`` attached (``None``: the plain model,
    dense attention), on fake CUDA copies of a copy of the model and of the cache: the whole step as a GPU user
    compiles it, a global layer's qada step one opaque ``qada::decode_buffer`` call (its kernels are not in this
    code). Call :func:`pretend_cuda_device` first."""
    import copy

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from benchmarks.compile_trace import prefill_static
    from qada.models import attach

    model = copy.deepcopy(model)  # (made a fake CUDA model below)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    if run is not None:
        attach(model, run)
    try:
        step = prefill_static(model, ids, mask=mask)
        torch.__future__.set_overwrite_module_params_on_conversion(True)  # (fake parameters replace real ones)
        with taking_code() as codes, FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            model.to("cuda")
            for layer in step["past_key_values"].layers:
                for name, value in list(vars(layer).items()):
                    if isinstance(value, torch.Tensor):
                        setattr(layer, name, fake_cuda(value))
                    elif isinstance(value, torch.device):
                        setattr(layer, name, torch.device("cuda"))
            kwargs = {name: fake_cuda(value) if isinstance(value, torch.Tensor) else value
                      for name, value in step.items()}
            forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
            compile_until_taken(lambda: forward(**kwargs), codes, "the decode step")
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        if run is not None:
            run.remove()
    return codes[0]


QADA_OPERATION = "qada.decode_buffer"


def bounds_operations(batch: int, slots: int) -> int:
    """The device operations (:data:`benchmarks.dispatch_count.NO_KERNEL` aside) with which a decode step derives its
    rows' bounds from a bool mask ``[batch, 1, 1, slots]`` and positions ``[batch, 1]``
    (:func:`~qada.models.guards.buffer_row_bounds`), counted by running it on the CPU."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks.dispatch_count import NO_KERNEL
    from qada.models.guards import buffer_row_bounds

    count = 0

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal count
            count += not (func.is_view or str(func.overloadpacket) in NO_KERNEL)
            return func(*args, **(kwargs or {}))

    mask = torch.ones(batch, 1, 1, slots, dtype=torch.bool)
    with Counter():
        buffer_row_bounds(mask, slots, torch.full((batch, 1), slots - 1))
    return count


def forward_kernels(code: str, per_call: int, derive: int) -> dict[str, Any]:
    """The kernels per decode step of :func:`forward_code`'s ``code`` with each ``qada::decode_buffer`` call replaced
    by what it runs on the device: ``per_call`` kernels (its layer step's: :func:`measure`'s ``per_layer``) and,
    where the call derives the rows' bounds, ``derive`` operations (:func:`bounds_operations`). A call derives them
    unless it passes neither mask nor positions, or the same ones as the call that last derived them (the run keeps
    bounds per mask object). ``{"graph": the kernels besides qada's calls, "calls", "deriving", "total"}``."""
    found = kernels(code)
    calls = [k for k in found if k["kind"] == "fallback" and k["name"] == QADA_OPERATION]
    deriving, last = 0, None
    for call in calls:
        given = tuple(call["args"][3:5])
        if given != ("None", "None") and given != last:
            deriving, last = deriving + 1, given
    graph = len(found) - len(calls)
    return {"graph": graph, "calls": len(calls), "deriving": deriving,
            "total": graph + len(calls) * per_call + deriving * derive}


def measure(model: Any, run: Any, ids: Any, mask: Any, longer: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """One configuration's row: the compiled step's kernels (and, fused, the launch comparison with eager) after
    prefilling ``ids [b, T]`` with ``mask``; with ``longer`` (``(ids, mask)`` of another length), also the kernels
    of the step compiled once more with symbolic sizes (``kernels_symbolic``)."""
    from benchmarks.compile_trace import capture_layer_step

    step, args = capture_layer_step(model, run, ids, mask)
    arg_sets = [args] + ([capture_layer_step(model, run, *longer)[1]] if longer is not None else [])
    codes = inductor_code(step, *arg_sets)
    found = kernels(codes[0])
    row: dict[str, Any] = {"kernels": [{"kind": k["kind"], "name": k["name"]} for k in found]}
    if longer is not None:
        row["kernels_symbolic"] = [{"kind": k["kind"], "name": k["name"]} for k in kernels(codes[1])]
    for kind in ("launch", "inductor", "extern", "fallback"):
        row[kind] = sum(k["kind"] == kind for k in found)
    executor = run.executor.registry_name
    row["executor_launches"] = 0 if step.fused is not None else EXECUTOR_LAUNCHES.get(executor, 0)
    row["per_layer"] = len(found) + row["executor_launches"]
    if step.fused is not None:
        row["differences"] = compare_launches(eager_launches(step, args),
                                              [k for k in found if k["kind"] == "launch"], args)
    return row


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=256, help="prompt length in tokens")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    parser.add_argument("--forward", default=",".join(FORWARD),
                        help="comma-separated names of CONFIGS (or 'dense') whose whole decode step is compiled too "
                             "('' for none)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.configs.split(",") if name.strip()]
    forward = [name.strip() for name in args.forward.split(",") if name.strip()]
    unknown = [name for name in names + forward if name not in CONFIGS and name != "dense"]
    if unknown:
        parser.error(f"unknown configurations {unknown}; expected some of {list(CONFIGS)}")
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: kernels as a GPU compiles them
    os.environ["QADA_COMPILE"] = "0"  # the runs prefill eagerly; the step is compiled here
    import torch
    import triton

    from benchmarks.common import machine_info, table, write_results
    from benchmarks.kernel_resources import H100_SMS
    from qada.eval.passkey import passkey_prompt
    from qada.models import build_run, load_default_model, prepare_run

    pretend_cuda_device()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model, tokenizer = load_default_model()
    def two_rows(length: int) -> tuple[Any, Any]:  # the second row left-padded by 5 tokens
        one = passkey_prompt(tokenizer, length=length, depth=0.5).input_ids
        ids = torch.cat([one, one.roll(7, dims=1)])
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        return ids, mask

    ids, mask = two_rows(args.length)
    longer = two_rows(args.length + 64)  # a second cache size: the step compiles once more, sizes symbolic
    rows = {}
    for name in names:
        config = CONFIGS[name]
        run = prepare_run(build_run(moments=config.get("moments", "stored"), criterion=config["criterion"],
                                    executor=config["executor"], compile=True), model, tokenizer)
        rows[name] = row = measure(model, run, ids, mask, longer)
        print(f"{name}: {row['per_layer']} kernels per layer ({row['launch']} launches, {row['inductor']} "
              f"Inductor, {row['extern']} extern, {row['fallback']} fallbacks, {row['executor_launches']} by the "
              f"executor after the step); differences from eager: {row.get('differences', 'n/a')}", flush=True)
    steps = {}
    derive = bounds_operations(*ids.shape)
    for name in forward:
        run = None
        if name != "dense":
            config = CONFIGS[name]
            run = prepare_run(build_run(moments=config.get("moments", "stored"), criterion=config["criterion"],
                                        executor=config["executor"], compile=True), model, tokenizer)
        row = rows.get(name) or (measure(model, run, ids, mask) if run is not None else {"per_layer": 0})
        steps[name] = step = forward_kernels(forward_code(model, run, ids, mask), row["per_layer"], derive)
        step["per_call"] = row["per_layer"]
        print(f"{name}, whole decode step: {step['total']} kernels ({step['graph']} in the model's graph, "
              f"{step['calls']} qada calls of {step['per_call']}, {step['deriving']} deriving the rows' bounds)",
              flush=True)
    layers = model.config.num_hidden_layers
    for step in steps.values():
        step["extra_per_layer"] = ((step["total"] - steps["dense"]["total"]) / layers if "dense" in steps
                                   else None)
    command = f"bash scripts/gpu-versions.sh --python benchmarks/inductor_code.py --length {args.length}"
    results = {"command": command, "machine": machine_info("cpu"),
               "torch": torch.__version__, "triton": triton.__version__, "model": "SmolLM2-135M (embedded)",
               "rows_of_batch": 2, "prompt_tokens": args.length, "rows": rows, "bounds_operations": derive,
               "decode_steps": steps}
    lines = ["# The kernels of a compiled layer step on a CUDA GPU, from Inductor's output code (made on the CPU)", "",
             f"Command: `{command}`; "
             f"torch {torch.__version__}, triton {triton.__version__}, a pretended sm_90 device ({H100_SMS} SMs). "
             "SmolLM2-135M, two rows (the second left-padded), the first decode step's layer step compiled as a run "
             "with `compile=True` compiles it; nothing is run. *per layer*: the kernels one layer's step launches "
             "inside the model's CUDA graph: qada's Triton launches, the kernels Inductor generates, external ones "
             "(cuBLAS), aten fallbacks, and the `triton` executor's two launches after an unfused step. "
             "*as eager*: each compiled launch is the eager step's (kernel, grid, every argument). *symbolic "
             f"sizes*: the kernels of the step compiled once more at a second cache size ({args.length + 64}-token "
             "prompts), sizes symbolic, as a run meeting a second cache size recompiles.", "",
             table(["configuration", "per layer", "launches", "Inductor", "extern", "fallbacks", "executor after",
                    "as eager", "symbolic sizes"],
                   [[name, row["per_layer"], row["launch"], row["inductor"], row["extern"], row["fallback"],
                     row["executor_launches"],
                     "n/a" if "differences" not in row else ("yes" if not row["differences"]
                                                              else "; ".join(row["differences"][:3])),
                     "the same kernels" if row["kernels_symbolic"] == row["kernels"]
                     else f"{len(row['kernels_symbolic'])} kernels"]
                    for name, row in rows.items()]), "", "Kernels in order:", ""]
    for name, row in rows.items():
        lines.append(f"- **{name}**: " + ", ".join(f"{k['name']} ({k['kind']})" for k in row["kernels"]))
    if steps:
        lines += ["", "## The whole decode step", "",
                  f"`torch.compile(model.forward, fullgraph=True)` of the same first decode step ({layers} layers), "
                  "on fake CUDA copies of the model and its static cache, as a GPU user compiles it: *in the graph*: "
                  "the kernels of Inductor's code besides qada's calls (each global layer's step is one opaque "
                  "`qada::decode_buffer` call); *per call*: the kernels each call runs (the layer step's, above); "
                  "*deriving bounds*: the calls that derive the rows' bounds from the mask and positions they are "
                  f"given ({derive} operations each; a call given neither, or the same ones as the call before, "
                  "reuses them); *per step*: all of it; *extra per layer*: against the dense model's step. A GPU "
                  "counts the kernels themselves (`benchmarks/run.py --gpu`); this is what Inductor's code and the "
                  "step's launches add up to.", "",
                  table(["configuration", "in the graph", "qada calls", "per call", "deriving bounds", "per step",
                         "extra per layer"],
                        [[name, step["graph"], step["calls"], step["per_call"], step["deriving"], step["total"],
                          "" if step["extra_per_layer"] is None else f"{step['extra_per_layer']:+.2f}"]
                         for name, step in steps.items()])]
    paths = write_results(args.out, "inductor-code-cpu", results, "\n".join(lines) + "\n")
    print(paths[1].read_text())
    return paths[1]


if __name__ == "__main__":
    main()
