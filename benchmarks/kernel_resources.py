"""What each Triton kernel qada launches asks of a Hopper GPU (sm_90: H100, H200), compiled on the CPU, no GPU needed.

    python benchmarks/kernel_resources.py                 # SmolLM2 (bf16, float32), Llama-3-8B and Gemma-2-9B layers
    python benchmarks/kernel_resources.py --out /tmp/res

A decode kernel is bound by the bytes it moves, and it moves them at full speed only with enough programs resident on
each SM to keep loads in flight. Registers decide that first: a kernel that needs more than the register file holds
for several programs, or spills registers to local memory (extra memory traffic inside its loops), cannot reach the
copy bandwidth whatever its grid. Both are fixed at compile time, so they can be read here.

For each model shape and configuration this script attaches the configuration to a model, prefills a short prompt and
runs one decode step with every Triton launch replaced by a compilation for sm_90: the kernel with the arguments,
specialisations and launch options the step passes (as on a GPU: the interpreter's bfloat16 workaround off), through
Triton to PTX, then ``ptxas -v`` (the one Triton ships) for the registers per thread and the bytes spilled. Nothing
runs on a GPU and no kernel is launched. It reports per distinct compiled kernel the registers, spills, shared
memory, warps and pipeline stages, and how many of its programs fit on one SM (65,536 registers, allocated per warp
in units of 256; 64 warps; 32 programs; 228 KiB of shared memory, 1 KiB reserved per program).

The shapes: SmolLM2-135M (the embedded model, real weights: 9 query heads, 3 KV heads, d = 64) in bfloat16 (what the
GPU suite times) and float32 (what the device parity test decodes), and one layer of Llama-3-8B (32 query heads, 8 KV
heads, d = 128; random weights, current moments) and one global layer of Gemma-2-9B (16 query heads, 8 KV heads,
d = 256, scores soft-capped at 50, as in every Gemma-2 global layer) in bfloat16. Writes
``<out>/kernel-resources-sm90-triton<version>.{json,md}``: registers depend on the Triton version (and its ptxas), so
run it with the version the GPU machine has too (``/tmp/qada-gpu-versions/bin/python``, built by
``scripts/gpu-versions.sh``).

It changes process-wide state (Triton's active driver, the executors' device check): run it as a process of its own,
without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS: dict[str, dict[str, Any]] = {  # name: build_run arguments, the GPU suite's Triton rows
    "qada dense": {"criterion": "dense", "moments": "none", "executor": {"name": "triton"}},
    "qada": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton"}},
    "qada fused": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton_fused"}},
    "qada fused estimating": {"criterion": {"name": "qada", "tau": 0.6},
                              "executor": {"name": "triton_fused", "estimate_in_splits": True}},
    "qada fused once": {"criterion": {"name": "qada", "tau": 0.6},
                        "executor": {"name": "triton_fused", "decide_once": True}},
    "qada_tail fused": {"criterion": {"name": "qada_tail", "tau": 0.3},  # (the decision in every split)
                        "executor": {"name": "triton_fused", "decide_once": False}},
    "qada_tail fused once": {"criterion": {"name": "qada_tail", "tau": 0.3},
                             "executor": {"name": "triton_fused", "decide_once": True}},
    "qada_budget fused": {"criterion": {"name": "qada_budget", "sparsity": 0.85}, "executor": {"name": "triton_fused"}},
    "qada_tail_budget fused": {"criterion": {"name": "qada_tail_budget", "sparsity": 0.85},
                               "executor": {"name": "triton_fused"}},
    "qada_tail+E fused": {"criterion": {"name": "qada_tail", "tau": 0.3, "attend_exact": True},
                          "executor": {"name": "triton_fused", "decide_once": False}},
    "qada_tail+E/lean fused": {"criterion": {"name": "qada_tail", "tau": 0.3, "attend_exact": True, "super_page": 16,
                                             "super_pages": 4, "pages": 4, "heavy": 16, "scale_exact": 8192,
                                             "shrink_exact": False},  # (qada.criteria.READ_LEAN)
                               "executor": {"name": "triton_fused"}},
    "qada fused pdl": {"criterion": {"name": "qada", "tau": 0.6}, "executor": {"name": "triton_fused", "pdl": True}},
    "qada_tail fused pdl": {"criterion": {"name": "qada_tail", "tau": 0.3},
                            "executor": {"name": "triton_fused", "decide_once": False, "pdl": True}},
}  # fmt: skip

SM90 = {"registers": 65536, "register_unit": 256, "warps": 64, "programs": 32, "shared": 228 * 1024,
        "reserved_shared": 1024}  # fmt: skip
"""One sm_90 SM's limits on resident programs (H100 and H200 alike)."""


@dataclass(frozen=True)
class Shape:
    """A model to attach the configurations to: ``model`` ``"smollm2"`` (real weights, stored moments),
    ``"llama3-8b-layer"`` or ``"gemma2-9b-layer"`` (one Llama-3-8B layer, or one global Gemma-2-9B layer: head size
    256 and soft-capped scores; random weights, current moments), with a static cache of
    ``capacity`` slots (the GPU suite's context length and its 64 decode slots: the page count decides which
    variant of the ``qada_tail`` kernels a step launches) holding a 512-token prompt."""

    name: str
    model: str
    dtype: str
    capacity: int


SHAPES = (Shape("SmolLM2-135M bf16 7.68k", "smollm2", "bfloat16", 7680 + 64),
          Shape("SmolLM2-135M float32 7.68k", "smollm2", "float32", 7680 + 64),
          Shape("SmolLM2-135M bf16 1k", "smollm2", "bfloat16", 1024),
          Shape("Llama-3-8B layer bf16 128k", "llama3-8b-layer", "bfloat16", 131072 + 64),
          Shape("Gemma-2-9B layer bf16 8k", "gemma2-9b-layer", "bfloat16", 8192 + 64))  # fmt: skip


H100_SMS = 132
"""SMs of an H100 SXM (an H200 has as many): the executors' split count is planned from it."""


def use_sm_count(sms: int) -> None:
    """Make the ``triton`` executors plan their splits for a GPU of ``sms`` SMs (they take 1 for CPU tensors): a
    split count of 1 would be compiled as a constant, not as the GPU compiles it. Process-wide."""
    from qada.attention import triton_decode

    triton_decode._num_sms = lambda device: sms


def programs_per_sm(registers: int, warps: int, shared: int) -> dict[str, int]:
    """How many programs of a kernel with ``registers`` per thread, ``warps`` warps and ``shared`` bytes of shared
    memory fit on one sm_90 SM, by each limit and in all (``resident``)."""
    per_warp = math.ceil(registers * 32 / SM90["register_unit"]) * SM90["register_unit"]
    by_registers = (SM90["registers"] // per_warp) // warps
    by_shared = SM90["shared"] // (shared + SM90["reserved_shared"])
    by_warps = SM90["warps"] // warps
    resident = min(by_registers, by_shared, by_warps, SM90["programs"])
    return {"by_registers": by_registers, "by_shared": by_shared, "by_warps": by_warps, "resident": resident}


def ptxas_report(ptx: str) -> dict[str, int]:
    """``ptxas -v`` for sm_90a on ``ptx``: registers per thread, spill stores and loads (bytes), stack frame."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        try:
            ptxas = get_ptxas(90)  # Triton 3.3, 3.4 and 3.6 on: the ptxas for the architecture
        except TypeError:
            ptxas = get_ptxas()  # Triton 3.5
        path = ptxas[0] if isinstance(ptxas, tuple) else ptxas.path  # (3.3: a (path, version) pair)
        done = subprocess.run([path, "-v", "--gpu-name", "sm_90a", str(source), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, check=True)
    log = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"could not read ptxas's report:\n{log}")
    return {"registers": int(registers.group(1)), "stack": int(spills.group(1)),
            "spill_stores": int(spills.group(2)), "spill_loads": int(spills.group(3))}


def grid_dependency(ptx: str) -> dict[str, int]:
    """The programmatic dependent launch instructions in ``ptx``: ``griddepcontrol.launch_dependents`` (the next
    launch may start) and ``griddepcontrol.wait`` (wait for the previous launch)."""
    return {"pdl_starts": len(re.findall(r"griddepcontrol\.launch_dependents", ptx)),
            "pdl_waits": len(re.findall(r"griddepcontrol\.wait", ptx))}


def pretend_programmatic_launch() -> None:
    """The ``triton_fused`` executor's ``pdl`` applies here as on an sm_90 GPU (its check of the device, a CPU one
    here, skipped; not that of the Triton version): its configurations compile their kernels as a GPU launches them.
    Process-wide."""
    from qada.attention import _triton_kernel
    from qada.attention.fused import FusedTritonExecutor

    FusedTritonExecutor.programmatic = lambda self, device: self.pdl and _triton_kernel.HAS_PDL


def async_copies(ptx: str) -> int:
    """The asynchronous global-to-shared copies (``cp.async.ca`` / ``.cg``) in ``ptx``: how Triton's software
    pipelining issues a loop's next loads while the current block is computed (a loop it does not pipeline loads
    into registers with ``ld.global`` and waits for them)."""
    return len(re.findall(r"\bcp\.async\.c[ag]\.", ptx))


def pack_args(kernel: Any, backend: Any, kwargs: dict[str, Any], bound: Any, specialization: Any,
              options: Any) -> tuple[Any, dict[str, Any], dict[Any, Any], dict[Any, Any]]:
    """``(options, signature, constexprs, attrs)`` of a launch, as Triton's launcher builds them before compiling:
    ``JITFunction._pack_args`` (Triton 3.5 on), or the same steps of ``JITFunction.run`` (3.3, 3.4), its check of the
    launch's keyword arguments included."""
    if hasattr(kernel, "_pack_args"):
        return kernel._pack_args(backend, kwargs, bound, specialization, options)
    from triton._utils import find_paths_if, get_iterable_path

    options = backend.parse_options(kwargs)
    sigkeys = [param.name for param in kernel.params]
    sigvals = [kind for kind, _ in specialization]
    unknown = [name for name in kwargs if name not in options.__dict__ and name not in sigkeys]
    if unknown:
        raise KeyError(f"Triton does not know the launch options {unknown}")
    constexprs = {path: get_iterable_path(list(bound.values()), path)
                  for path in find_paths_if(sigvals, lambda _, kind: kind == "constexpr")}
    attrvals = [attr for _, attr in specialization]
    attrs = {path: backend.parse_attr(get_iterable_path(attrvals, path))
             for path in find_paths_if(attrvals, lambda _, attr: isinstance(attr, str))}
    return options, dict(zip(sigkeys, sigvals, strict=True)), constexprs, attrs


class Sm90Compiler:
    """Stands in for ``qada.attention._triton_kernel.run``: compiles each launch for sm_90 instead of running it,
    once per distinct kernel, specialisation and launch options; ``kernels`` maps that key to its report.
    ``float_scalars``: the type a Python float argument is compiled as: ``"fp32"`` (Triton's own launcher) or
    ``"fp64"`` (what ``torch.compile`` gives a kernel it launches from a compiled function)."""

    def __init__(self, float_scalars: str = "fp32") -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", 90, 32)
        self.backend = make_backend(self.target)
        self.kernels: dict[tuple, dict[str, Any]] = {}
        self.binders: dict[Any, Any] = {}  # kernel -> Triton's argument binder for the target (built once)
        self.config: tuple[str, str] = ("", "")  # (shape, configuration) of the launches to come
        self.float_scalars = float_scalars

    def __call__(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        from triton.compiler import ASTSource, compile
        from triton.runtime.jit import create_function_from_signature

        if kernel not in self.binders:  # (every layer of every step launches the same few kernels)
            self.binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        bound, specialization, options = self.binders[kernel](*args, **kwargs)
        options, signature, constexprs, attrs = pack_args(kernel, self.backend, kwargs, bound, specialization,
                                                          options)  # fmt: skip
        signature = {name: self.float_scalars if kind == "fp32" else kind for name, kind in signature.items()}
        key = (kernel.fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items(), key=repr)),
               repr(sorted(attrs.items(), key=repr)), options.num_warps, options.num_stages, options.maxnreg)
        if key in self.kernels:
            if self.config not in self.kernels[key]["configs"]:
                self.kernels[key]["configs"].append(self.config)
            return
        compiled = compile(ASTSource(kernel, signature, constexprs, attrs), target=self.target,
                           options=options.__dict__)
        report = ptxas_report(compiled.asm["ptx"])
        report["async_copies"] = async_copies(compiled.asm["ptx"])
        report.update(grid_dependency(compiled.asm["ptx"]))
        shared = int(compiled.metadata.shared)
        flags = {name: kwargs[name] for name in ("ATTEND", "SCORE", "CANDIDATES", "SOFTCAP", "PDL", "PAGE_TOPS",
                                                 "ALL_DENSE", "RANK", "HEADS_APART", "POLICY") if name in kwargs}
        self.kernels[key] = {"kernel": kernel.fn.__name__, "configs": [self.config], "flags": flags,
                             "warps": options.num_warps, "stages": options.num_stages, "maxnreg": options.maxnreg,
                             "shared": shared, **report,
                             **programs_per_sm(report["registers"], options.num_warps, shared)}


def load_shape(shape: Shape) -> tuple[Any, Any, Any, str]:
    """``(model, tokenizer or None, prompt ids [1, T], moments)`` for ``shape``."""
    import torch
    import transformers

    dtype = getattr(torch, shape.dtype)
    if shape.model == "smollm2":
        from qada.eval.passkey import passkey_prompt
        from qada.models import load_default_model

        model, tokenizer = load_default_model(dtype=dtype)
        return model, tokenizer, passkey_prompt(tokenizer, length=512, depth=0.5).input_ids, "stored"
    torch.manual_seed(0)
    if shape.model == "gemma2-9b-layer":
        config = transformers.Gemma2Config(hidden_size=3584, num_hidden_layers=1, num_attention_heads=16,
                                           num_key_value_heads=8, head_dim=256, intermediate_size=1024,
                                           vocab_size=1000, layer_types=["full_attention"],
                                           attn_logit_softcapping=50.0, attn_implementation="eager")  # fmt: skip
        model = transformers.Gemma2ForCausalLM(config).to(dtype).eval()
        return model, None, torch.randint(0, 1000, (1, 512)), "current"
    config = transformers.LlamaConfig(hidden_size=4096, num_hidden_layers=1, num_attention_heads=32,
                                      num_key_value_heads=8, intermediate_size=1024, vocab_size=1000,
                                      rope_theta=500000.0, attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    return model, None, torch.randint(0, 1000, (1, 512)), "current"


def compile_steps(compiler: Sm90Compiler, label: str, model: Any, tokenizer: Any, ids: Any, moments: Any,
                  capacity: int, configs: dict[str, dict[str, Any]] | None = None) -> None:
    """For each of ``configs`` (default :data:`CONFIGS`): attach it to ``model``, prefill ``ids [1, T]`` into a static
    cache of ``capacity`` slots and run one decode step, its launches compiled by ``compiler`` under ``(label,
    configuration)``. ``moments``: the moment source of the configurations that do not name one."""
    import torch

    from benchmarks.compile_trace import prefill_static
    from qada.models import attach, build_run, prepare_run

    for name, config in (configs or CONFIGS).items():
        compiler.config = (label, name)
        run = prepare_run(build_run(moments=config.get("moments", moments), criterion=config["criterion"],
                                    executor=config["executor"], compile=False), model, tokenizer)  # fmt: skip
        attach(model, run)
        try:
            with torch.no_grad():
                model(**prefill_static(model, ids, capacity))
        finally:
            run.remove()
        print(f"{label}, {name}: {len(compiler.kernels)} kernels compiled so far", flush=True)


def registers(kernel: dict[str, Any]) -> str:
    """A report row's registers per thread, with the launch's cap where it gave one: ``"168 (cap 168)"``."""
    cap = kernel.get("maxnreg")
    return str(kernel["registers"]) if cap is None else f"{kernel['registers']} (cap {cap})"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--shapes", nargs="+", default=[s.name for s in SHAPES], choices=[s.name for s in SHAPES],
                        metavar="SHAPE", help=f"among {[s.name for s in SHAPES]}")
    parser.add_argument("--float-scalars", default="fp32", choices=["fp32", "fp64"],
                        help="the type of a Python float argument: fp32 as Triton launches a kernel, fp64 as a "
                             "function compiled by torch.compile does (results named ...-fp64)")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: the kernels as a GPU compiles them
    os.environ["QADA_COMPILE"] = "0"

    import torch
    import triton

    from benchmarks.common import machine_info, table, write_results
    from benchmarks.compile_trace import pretend_cuda_triton
    from qada.attention import _triton_kernel

    pretend_cuda_triton()
    pretend_programmatic_launch()
    use_sm_count(H100_SMS)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    compiler = Sm90Compiler(args.float_scalars)
    _triton_kernel.run = compiler
    for shape in SHAPES:
        if shape.name in args.shapes:
            model, tokenizer, ids, moments = load_shape(shape)
            compile_steps(compiler, shape.name, model, tokenizer, ids, moments, shape.capacity)
    rows = list(compiler.kernels.values())
    command = "python benchmarks/kernel_resources.py" + (
        "" if len(args.shapes) == len(SHAPES) else " --shapes " + " ".join(repr(s) for s in args.shapes)) + (
        "" if args.float_scalars == "fp32" else f" --float-scalars {args.float_scalars}")
    results = {"command": command, "machine": machine_info("cpu"), "triton": triton.__version__,
               "target": "cuda sm_90 (ptxas -v, sm_90a)", "sm90_limits": SM90, "kernels": rows}
    lines = ["# qada's Triton kernels compiled for sm_90 (H100, H200), on the CPU", "",
             f"Command: `{command}`; torch {torch.__version__}, triton {triton.__version__} and its ptxas. Each row "
             "is one distinct compiled kernel (kernel, argument types and specialisations, constants, warps, "
             "stages, register cap) that one decode step of the listed configurations launches. *registers*: per "
             "thread, with the launch's cap (Triton's `maxnreg`) where it gives one. *spilled*: bytes of spill "
             "stores / loads per thread (local-memory traffic); *async copies*: `cp.async` instructions in the PTX "
             "(a software-pipelined loop loads its next blocks with them while it computes; the splits' attention "
             "loops should have as many as the plain `qada_decode_split_kernel`'s); *griddepcontrol*: the "
             "programmatic dependent launch instructions (`launch_dependents`: the next launch may start; `wait`: "
             "for the previous one), in the `pdl` configurations only; *per SM*: programs of the "
             "kernel resident on one SM, the least of the limits by registers, shared memory and warps (and 32).",
             ""]
    for shape in SHAPES:
        chosen = [r for r in rows if any(c[0] == shape.name for c in r["configs"])]
        if not chosen:
            continue
        lines += [f"## {shape.name} ({shape.capacity:,} cache slots)", "",
                  table(["kernel", "flags", "warps", "stages", "registers", "spilled (B)", "shared (B)",
                         "async copies", "griddepcontrol (starts / waits)", "per SM (regs / smem / warps)",
                         "configurations"],
                        [[r["kernel"], ", ".join(f"{k}={int(v)}" for k, v in r["flags"].items()) or "-", r["warps"],
                          r["stages"], registers(r), f"{r['spill_stores']} / {r['spill_loads']}", r["shared"],
                          r["async_copies"], f"{r['pdl_starts']} / {r['pdl_waits']}",
                          f"**{r['resident']}** ({r['by_registers']} / {r['by_shared']} / {r['by_warps']})",
                          ", ".join(c[1] for c in r["configs"] if c[0] == shape.name)] for r in chosen]), ""]
    name = f"kernel-resources-sm90-triton{triton.__version__}" + (
        "" if args.float_scalars == "fp32" else f"-{args.float_scalars}")
    paths = write_results(args.out, name, results, "\n".join(lines))
    print(paths[1].read_text())
    return paths[1]


if __name__ == "__main__":
    main()
