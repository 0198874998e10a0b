"""Reference keys: a reference prompt run once through the model, its post-RoPE keys per layer and KV head.

The keys come from the model's own cache (``DynamicCache.layers[i].keys``, ``[1, H_kv, T, d]``), so they are
exactly what decoding would see. On a hybrid model the cache keeps every key of the sliding-window layers too
(they are never used: those layers pass through qada), so the format stays one tensor over all layers. The
prompt runs in chunks with the cache, which bounds memory and lets a progress bar move; chunked and unchunked
runs give the same keys.

This module holds the model-running I/O of the ``stored`` and ``bucketed`` sources:
:func:`load_or_build_reference` builds the reference prompt, runs the model and caches the keys under
:func:`reference_cache_file`; the sources themselves only call it from ``prepare``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qada.artifacts import ArtifactError, load_artifact, model_fingerprint, save_artifact
from qada.cache import cache_dir as resolve_cache_dir
from qada.functional.checks import check_covariance
from qada.moments.math import MomentState, block_moments

__all__ = [
    "MAX_REFERENCE_LENGTH",
    "BucketedMomentsData",
    "ReferenceKeys",
    "bucket_ends",
    "collect_reference_keys",
    "compute_bucketed_moments",
    "fingerprint_key",
    "load_or_build_reference",
    "processor_name",
    "reference_build_conditions",
    "reference_cache_file",
    "reference_length",
]

MAX_REFERENCE_LENGTH = 32768


@dataclass
class ReferenceKeys:
    """Post-RoPE keys of a reference prompt: ``keys [L, H_kv, N, d]`` plus the model fingerprint and details.

    ``info`` records how the prompt was made (``prompt``, ``seed``, ``length``, ...); ``path`` is the file the keys
    were loaded from or cached to (``None``: built in memory and not saved).
    """

    keys: torch.Tensor
    fingerprint: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.keys, torch.Tensor) or self.keys.ndim != 4:
            shape = tuple(self.keys.shape) if isinstance(self.keys, torch.Tensor) else type(self.keys).__name__
            raise ValueError(f"expected reference keys of shape [layers, kv_heads, length, head_dim] but got {shape}")
        L, H_kv, _, d = self.keys.shape
        for name, value in (("num_layers", L), ("num_kv_heads", H_kv), ("head_dim", d)):
            if self.fingerprint.get(name, value) != value:
                raise ValueError(f"expected {name}={self.fingerprint[name]} from the fingerprint but got {value}")

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def save(self, path: str | os.PathLike) -> Path:
        return save_artifact(path, "reference_keys", {"keys": self.keys}, self.fingerprint, info=self.info)

    @classmethod
    def load(cls, path: str | os.PathLike, fingerprint: dict[str, Any] | None = None) -> ReferenceKeys:
        """Load and check; ``fingerprint`` (if given) must match the file's."""
        tensors, info = load_artifact(path, "reference_keys", required=("keys",), fingerprint=fingerprint)
        keys = tensors["keys"]
        expected = [info.model.get(k) for k in ("num_layers", "num_kv_heads")]
        if keys.ndim != 4 or [keys.shape[0], keys.shape[1]] != expected or keys.shape[3] != info.model.get("head_dim"):
            raise ArtifactError(
                f"artifact {info.path!r} holds keys of shape {list(keys.shape)}, which do not fit its model "
                f"(layers, kv_heads, head_dim = {expected + [info.model.get('head_dim')]})"
            )
        if not keys.dtype.is_floating_point or not bool(torch.isfinite(keys).all()):
            raise ArtifactError(f"artifact {info.path!r} holds keys that are not finite floats ({keys.dtype})")
        return cls(keys, dict(info.model), dict(info.info), os.fspath(path))


@torch.no_grad()
def collect_reference_keys(
    model: Any,
    input_ids: torch.Tensor,
    chunk_size: int | None = 1024,
    progress: bool | Callable[[int], None] = False,
    dtype: torch.dtype = torch.float32,
    info: dict[str, Any] | None = None,
) -> ReferenceKeys:
    """Run ``input_ids [1, N]`` (or ``[N]``) through ``model`` with a cache and keep every layer's keys.

    Args:
        chunk_size: tokens per forward (``None``: one forward); the cache carries the context between chunks.
        progress: True for a tqdm bar, or a callable receiving the number of tokens done after each chunk.
        dtype: dtype of the returned keys.
    """
    from transformers import DynamicCache

    ids = torch.as_tensor(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"expected one non-empty reference prompt [1, N] but got shape {tuple(ids.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"expected chunk_size >= 1 or None but got {chunk_size}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    N = ids.shape[1]
    step = N if chunk_size is None else chunk_size
    bar = None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=N, unit="tok", desc="reference keys")
    # No config: every layer is a plain DynamicLayer that keeps all its keys, sliding-window layers of a hybrid
    # model included (a config'd cache keeps only their last window - 1). The model still builds its sliding
    # masks from positions, so every layer's keys are the same as with its own cache; the sliding layers' keys
    # are never read by a moment source, they only keep the [L, H_kv, N, d] format.
    cache = DynamicCache()
    for lo in range(0, N, step):
        hi = min(N, lo + step)
        position = torch.arange(lo, hi, device=device)[None]
        model(
            input_ids=ids[:, lo:hi],
            past_key_values=cache,
            use_cache=True,
            position_ids=position,
            cache_position=position[0],
            logits_to_keep=1,
        )
        if bar is not None:
            bar.update(hi - lo)
        elif callable(progress):
            progress(hi)
    if bar is not None:
        bar.close()
    keys = torch.stack([layer.keys[0].to(device="cpu", dtype=dtype) for layer in cache.layers])
    if keys.shape[2] != N:
        raise RuntimeError(f"expected the cache to hold {N} keys but it holds {keys.shape[2]}")
    return ReferenceKeys(keys, model_fingerprint(model.config, model), dict(info or {}, length=N))


# --- the cached reference of a model -----------------------------------------------------------------------


def reference_length(model: Any, length: int | None = None) -> int:
    """``length``, or the model's maximum positions (``config.max_position_embeddings``) capped at 32768."""
    if length is not None:
        return length
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(int(max_positions or MAX_REFERENCE_LENGTH), MAX_REFERENCE_LENGTH)


def fingerprint_key(fingerprint: dict[str, Any]) -> str:
    """16 hex digits identifying a model fingerprint (:func:`qada.artifacts.model_fingerprint`): part of every
    cached artifact's file name, and what a run's description reports."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def reference_cache_file(
    kind: str,
    fingerprint: dict[str, Any],
    prompt: str,
    length: int,
    seed: int,
    cache_dir: str | os.PathLike | None = None,
    extra: str = "",
) -> Path:
    """Where an artifact derived from a model's reference prompt is cached.

    ``<cache>/<kind>-<model_type>-<hash of the fingerprint>-<prompt>-n<length>-s<seed><extra>.safetensors``
    under :func:`qada.cache.cache_dir` (``cache_dir``, ``$QADA_CACHE_DIR`` or ``~/.cache/qada``).
    """
    key = fingerprint_key(fingerprint)
    model = fingerprint.get("model_type")
    name = f"{kind}-{model}-{key}-{prompt}-n{length}-s{seed}{extra}.safetensors"
    return resolve_cache_dir(cache_dir) / name


@functools.lru_cache(maxsize=2)
def _load_shared(path: str, stamp: tuple[int, int], fingerprint: str) -> ReferenceKeys:
    """One loaded copy per cached file (``stamp``: its mtime and size), shared by the sources that use it."""
    return ReferenceKeys.load(path, json.loads(fingerprint))


def reference_build_conditions(model: Any) -> str:
    """How a reference is built on this process: ``"<device> <dtype> (<processor>), torch <version>[, <n> threads]"``
    (threads on the CPU only), e.g. ``"cpu bfloat16 (Intel(R) Xeon(R) Processor), torch 2.13.0+cpu, 2 threads"``.

    Recorded in a cached reference's ``info["built"]`` because its keys depend on it: the forward's reductions in a
    low-precision dtype round differently with another thread count, processor or device (the embedded model in
    bfloat16 built with 1 thread instead of 2: 68% of the float16 key values differ, by up to 1.94), so two
    machines' caches of the same name may hold different keys, and the stored moments derived from them decide heads
    near tau differently."""
    parameter = next(iter(model.parameters()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    dtype = str(parameter.dtype).removeprefix("torch.") if parameter is not None else "unknown"
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return f"{device.type} {dtype} ({processor_name(device)}), torch {torch.__version__}{threads}"


def processor_name(device: torch.device) -> str:
    """The CUDA device's name, the CPU's model name (``/proc/cpuinfo``, else :func:`platform.processor`, else
    :func:`platform.machine`, else ``"unknown"``), or another device's type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def load_or_build_reference(
    model: Any,
    tokenizer: Any,
    prompt: str = "random_words",
    length: int | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    chunk_size: int | None = 1024,
) -> ReferenceKeys:
    """Reference keys of ``model``: loaded from the cache, or built and cached.

    Builds the ``prompt`` reference (:func:`qada.moments.prompts.build_reference_prompt`) of
    :func:`reference_length` tokens with ``tokenizer``, runs it through the model in chunks of ``chunk_size``
    (:func:`collect_reference_keys`; one line on stderr says so first, and its progress bar is removed when done)
    and saves the keys in float16 to :func:`reference_cache_file` (kind ``reference``), with how they were built in
    ``info["built"]`` (:func:`reference_build_conditions`). A cached file for the
    same model fingerprint, prompt, length and seed is loaded instead; one that fails its checks is rebuilt with
    a warning.

    Raises:
        ValueError: nothing is cached and ``tokenizer`` is None.
    """
    from qada.moments.prompts import build_reference_prompt

    fingerprint = model_fingerprint(model.config, model)
    length = reference_length(model, length)
    file = reference_cache_file("reference", fingerprint, prompt, length, seed, cache_dir)
    if file.exists():
        try:
            stat = file.stat()
            return _load_shared(str(file), (stat.st_mtime_ns, stat.st_size), json.dumps(fingerprint, sort_keys=True))
        except ArtifactError as error:
            warnings.warn(f"rebuilding the cached reference: {error}", stacklevel=2)
    if tokenizer is None:
        raise ValueError(
            f"expected a tokenizer to build the {prompt!r} reference prompt (or an artifact path) but got None"
        )
    from tqdm.auto import tqdm

    ids = build_reference_prompt(prompt, tokenizer, length, seed)
    info = {"prompt": prompt, "seed": seed, "built": reference_build_conditions(model)}
    # Said once, before the bar (tqdm.write keeps an open evaluation bar intact): the first use of the stored
    # moments takes a while, later runs load the file.
    tqdm.write(f"qada: building the stored-moment reference ({prompt}, {length} tokens) once; cached at {file}",
               file=sys.stderr)
    with tqdm(total=int(ids.numel()), unit="tok", desc="reference keys", leave=False) as bar:  # gone when done
        reference = collect_reference_keys(
            model, ids, chunk_size, progress=lambda done: bar.update(done - bar.n), dtype=torch.float32, info=info
        )
    # Cached in float16 (half the disk); use what was cached so fresh and cached runs agree.
    reference.keys = reference.keys.to(torch.float16)
    reference.save(file)
    reference.path = os.fspath(file)
    return reference


# --- bucketed moments --------------------------------------------------------------------------------------


def bucket_ends(length: int, bucket_size: int, first: int, min_keys: int = 64) -> list[int]:
    """Bucket end indices into a reference of ``length`` keys whose bulk starts at ``first``.

    Multiples of ``bucket_size`` up to ``length``, ``length`` itself, and below the first multiple a geometric
    ladder ``first + min_keys * 2^j`` so short prompts find a bucket too.
    """
    if bucket_size < 1:
        raise ValueError(f"expected bucket_size >= 1 but got {bucket_size}")
    ends = set(range(bucket_size, length + 1, bucket_size))
    small = first + max(1, min_keys)
    while small < min(bucket_size, length):
        ends.add(small)
        small = first + 2 * (small - first)
    ends.add(length)
    return sorted(e for e in ends if first < e <= length)


@dataclass
class BucketedMomentsData:
    """Moments of a reference bulk ``[first, end_j)`` for a grid of ends: ``ends [J]``, ``count [J]``,
    ``mean [L, J, H_kv, d]``, ``cov [L, J, H_kv, d, d]`` (population), float32 on disk."""

    ends: torch.Tensor
    mean: torch.Tensor
    cov: torch.Tensor
    first: int
    fingerprint: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        J = self.ends.shape[0]
        if (
            self.mean.ndim != 4
            or self.cov.ndim != 5
            or self.mean.shape[1] != J
            or self.cov.shape != (*self.mean.shape, self.mean.shape[3])
        ):
            raise ValueError(
                f"expected ends [J], mean [L, J, H_kv, d], cov [L, J, H_kv, d, d] but got "
                f"{list(self.ends.shape)}, "
                f"{list(self.mean.shape)}, {list(self.cov.shape)}"
            )
        if isinstance(self.first, bool) or not isinstance(self.first, int) or self.first < 0:
            raise ValueError(f"expected the bulk start first to be an int >= 0 but got {self.first!r}")
        if self.ends.dtype.is_floating_point or self.ends.dtype == torch.bool:
            raise ValueError(f"expected integer bucket ends but got {self.ends.dtype}")
        if J == 0 or not bool((self.ends[1:] > self.ends[:-1]).all()):
            raise ValueError(f"expected strictly increasing bucket ends but got {self.ends.tolist()}")
        if int(self.ends[0]) <= self.first:
            raise ValueError(f"expected bucket ends beyond the bulk start {self.first} but got {self.ends.tolist()}")

    def save(self, path: str | os.PathLike) -> Path:
        return save_artifact(
            path,
            "bucketed_moments",
            {"ends": self.ends.long(), "mean": self.mean.float(), "cov": self.cov.float()},
            self.fingerprint,
            window={"first": self.first},
            info=self.info,
        )

    @classmethod
    def load(
        cls, path: str | os.PathLike, fingerprint: dict[str, Any] | None = None, first: int | None = None
    ) -> BucketedMomentsData:
        """Load and check; ``first`` (the bulk start, ``T_sink`` or 0 with sinks) must match if given."""
        window = None if first is None else {"first": first}
        tensors, info = load_artifact(
            path, "bucketed_moments", required=("ends", "mean", "cov"), fingerprint=fingerprint, window=window
        )
        first = (info.window or {}).get("first")
        if isinstance(first, bool) or not isinstance(first, int):
            raise ArtifactError(f"artifact {info.path!r} has no integer bulk start 'first' in its window metadata "
                                f"(got {info.window!r})")
        try:
            data = cls(tensors["ends"], tensors["mean"], tensors["cov"], first, dict(info.model), dict(info.info))
            if not bool(torch.isfinite(data.mean).all()):
                raise ValueError("expected finite means but they hold NaN or inf")
            check_covariance("the covariances", data.cov)  # symmetric, positive semi-definite (float64)
        except (ValueError, TypeError) as error:
            raise ArtifactError(f"artifact {info.path!r} holds inconsistent bucketed moments ({error})") from error
        return data


def compute_bucketed_moments(
    reference: ReferenceKeys, bucket_size: int = 512, first: int = 16, min_keys: int = 64
) -> BucketedMomentsData:
    """Moments of ``reference.keys[:, :, first:end]`` for every end of :func:`bucket_ends`, in one pass.

    Each bucket merges the previous one with the keys in between (Chan), so the cost is O(N d²) in all.
    """
    from qada.moments.math import merge_moments, to_bulk_moments

    keys = reference.keys
    L, H_kv, N, d = keys.shape
    ends = bucket_ends(N, bucket_size, first, min_keys)
    if not ends:
        raise ValueError(f"expected a reference longer than its bulk start {first} but got {N} keys")
    means, covs = [], []
    state: MomentState = block_moments(keys[:, :, first:first])
    previous = first
    for end in ends:
        state = merge_moments(state, block_moments(keys[:, :, previous:end]))
        previous = end
        mean, cov = to_bulk_moments(state)
        means.append(mean)
        covs.append(cov)
    info = dict(reference.info, bucket_size=bucket_size, min_keys=min_keys)
    return BucketedMomentsData(
        torch.tensor(ends),
        torch.stack(means, 1),
        torch.stack(covs, 1),
        first,
        dict(reference.fingerprint),
        info,
    )
