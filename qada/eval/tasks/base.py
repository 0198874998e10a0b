"""The :class:`Sample` record, the :class:`Task` interface, the task registry and haystack sizing.

A task builds, for one sample and one haystack *size* (sentences, words, documents: whatever unit the task
grows), the task text, the reference outputs and the answer prefix. The base class does the rest, once:
it wraps the text in the prompt template (RULER's ``base`` template, or the tokenizer's chat template),
appends the answer prefix, and searches (bisection) the largest size whose tokenised prompt fits the target
length. Each sample draws its randomness from its own ``random.Random`` seeded from ``(seed, index)``, so a
sample is the same function of the size at every probe of the search and generation is deterministic.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from qada.registry import Component, Registry

__all__ = [
    "TASKS",
    "Built",
    "Sample",
    "Task",
    "count_tokens",
    "format_prompt",
    "register_task",
    "sample_rng",
]

PROMPT_TEMPLATES = ("base", "chat")


@dataclass
class Sample:
    """One prompt and its references, in RULER's jsonl fields plus what qada records.

    Attributes:
        task: the task name (``niah_single_1``, ``qa_2``, ...).
        index: position of the sample in its set.
        input: the full prompt the model completes (template applied, answer prefix at its end).
        outputs: the reference strings that the prediction is scored against.
        answer_prefix: the text that ends ``input`` and that the answer continues ("" if none).
        length: tokens of ``input`` under the tokenizer that sized it (``None`` when unknown, e.g. imported).
        template: ``"base"`` (completion style) or ``"chat"`` (the tokenizer's chat template).
        tokens_to_generate: RULER's generation budget for the task.
        metadata: task-specific facts (needle strings, their character spans and token positions, depths...).
    """

    task: str
    index: int
    input: str
    outputs: list[str]
    answer_prefix: str = ""
    length: int | None = None
    template: str = "base"
    tokens_to_generate: int = 128
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_ruler(self) -> dict[str, Any]:
        """The sample as a line of a RULER jsonl (``index``, ``input``, ``outputs``, ``length``, extras)."""
        return {
            "index": self.index,
            "input": self.input,
            "outputs": list(self.outputs),
            "length": self.length,
            "answer_prefix": self.answer_prefix,
            "task": self.task,
            "template": self.template,
        }


@dataclass
class Built:
    """What a task builds for one sample at one size: the task text (before templating), outputs, extras.

    ``needles`` are substrings of ``text`` whose character spans and token positions the base class records.
    """

    text: str
    outputs: list[str]
    answer_prefix: str
    needles: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


def sample_rng(seed: int, index: int, salt: str = "") -> random.Random:
    """The private random stream of sample ``index`` (a string seed: stable across processes)."""
    return random.Random(f"{seed}/{index}/{salt}")


def format_prompt(tokenizer: Any, text: str, answer_prefix: str, template: str) -> str:
    """``text`` in the prompt template, followed by ``answer_prefix``.

    ``base`` is RULER's ``"{task_template}"`` (the text as is); ``chat`` is the tokenizer's chat template with
    one user turn and the generation prompt, after which the answer prefix starts the assistant's turn.
    """
    if template == "base":
        return text + answer_prefix
    if template == "chat":
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("template='chat' needs a tokenizer with a chat template, but this one has none")
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return chat + answer_prefix
    raise ValueError(f"expected a prompt template in {list(PROMPT_TEMPLATES)} but got {template!r}")


def _encode(tokenizer: Any, text: str, template: str, **kw: Any) -> Any:
    # A chat prompt carries its own special tokens; a base prompt gets the tokenizer's (e.g. a BOS).
    return tokenizer(text, add_special_tokens=template == "base", **kw)


def count_tokens(tokenizer: Any, text: str, template: str = "base") -> int:
    """Tokens the model sees for prompt ``text`` (with the tokenizer's special tokens for ``base``)."""
    return len(_encode(tokenizer, text, template)["input_ids"])


class Task(Component, abc.ABC):
    """A RULER-compatible task: ``generate(tokenizer, length, num_samples, seed)`` returns sized samples.

    Subclasses are dataclasses whose fields are the task's configuration (RULER's ``synthetic.yaml`` args)
    and implement :meth:`build` and :meth:`size_range`. ``template`` picks ``"base"`` (default) or
    ``"chat"``. Class attributes: ``metric`` (``"string_match_all"`` or ``"string_match_part"``) and
    ``tokens_to_generate`` (RULER's budget).
    """

    metric: ClassVar[str] = "string_match_all"
    tokens_to_generate: ClassVar[int] = 128
    #: tolerance of the size search: the prompt ends within max(abs_tol, rel_tol * length) tokens of the target
    #: unless one unit of size is coarser than that (QA documents).
    rel_tol: ClassVar[float] = 0.03
    abs_tol: ClassVar[int] = 50

    def __post_init__(self) -> None:
        template = getattr(self, "template", "base")
        if template not in PROMPT_TEMPLATES:
            raise ValueError(f"expected template in {list(PROMPT_TEMPLATES)} but got {template!r}")

    # ---- what subclasses write -------------------------------------------------------------------------
    @abc.abstractmethod
    def build(self, rng: random.Random, size: int, length: int, index: int = 0) -> Built:
        """The task text of sample ``index`` with a haystack of ``size`` units (``length``: the target tokens).

        All randomness comes from ``rng`` (fresh and identical at every probe of the size search).
        """

    @abc.abstractmethod
    def size_range(self, length: int) -> tuple[int, int]:
        """Smallest and largest haystack size the search may use for a ``length``-token prompt."""

    def prepare(self, tokenizer: Any, length: int, seed: int) -> None:  # noqa: B027
        """Per-call set-up shared by all samples (e.g. a few-shot example); default none."""

    # ---- plumbing ----------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.registry_name or type(self).__name__

    def generate(self, tokenizer: Any, length: int, num_samples: int = 1, seed: int = 0) -> list[Sample]:
        """``num_samples`` prompts of at most ``length`` tokens each, deterministic given ``seed``.

        Args:
            tokenizer: the model's (Hugging Face) tokenizer, used for sizing and for the chat template.
            length: target prompt length in tokens (template and answer prefix included).
            num_samples: how many samples.
            seed: seeds every random choice (no global random state is touched).
        """
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"expected a target length >= 1 token but got {length!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"expected num_samples >= 0 but got {num_samples!r}")
        self.prepare(tokenizer, length, seed)
        samples = []
        hint = None
        for index in range(num_samples):
            sample, hint = self._sized_sample(tokenizer, length, seed, index, hint)
            samples.append(sample)
        return samples

    def _render(self, tokenizer: Any, seed: int, index: int, size: int, length: int) -> tuple[Built, str, int]:
        built = self.build(sample_rng(seed, index, self.name), size, length, index)
        prompt = format_prompt(tokenizer, built.text, built.answer_prefix, self.template)
        return built, prompt, count_tokens(tokenizer, prompt, self.template)

    def _sized_sample(self, tokenizer: Any, length: int, seed: int, index: int, hint: int | None) -> tuple[Sample, int]:
        lo_size, hi_size = self.size_range(length)
        cache: dict[int, tuple[Built, str, int]] = {}

        def probe(size: int) -> tuple[Built, str, int]:
            if size not in cache:
                cache[size] = self._render(tokenizer, seed, index, size, length)
            return cache[size]

        if probe(lo_size)[2] > length:
            raise ValueError(
                f"task {self.name!r} needs more than {length} tokens even with the smallest haystack "
                f"({probe(lo_size)[2]} tokens); ask for a longer prompt"
            )
        # Bracket [good, bad): good fits, bad does not (or is past the largest size). Gallop from the hint.
        good, bad = lo_size, hi_size + 1
        if hint is not None and lo_size < hint <= hi_size:
            step = max(1, hint // 64)
            if probe(hint)[2] <= length:
                good = hint
                while good + step <= hi_size and probe(good + step)[2] <= length:
                    good, step = good + step, 2 * step
                bad = min(good + step, hi_size + 1)
            else:
                bad = hint
                while bad - step > lo_size and probe(bad - step)[2] > length:
                    bad, step = bad - step, 2 * step
                good = max(bad - step, lo_size)
        while bad - good > 1:
            mid = (good + bad) // 2
            if probe(mid)[2] <= length:
                good = mid
            else:
                bad = mid
        built, prompt, tokens = probe(good)
        metadata = {"size": good, **built.metadata}
        if built.needles:
            metadata.update(_needle_positions(tokenizer, prompt, built.needles, self.template))
        sample = Sample(
            task=self.name,
            index=index,
            input=prompt,
            outputs=list(built.outputs),
            answer_prefix=built.answer_prefix,
            length=tokens,
            template=self.template,
            tokens_to_generate=self.tokens_to_generate,
            metadata=metadata,
        )
        return sample, good


def _needle_positions(tokenizer: Any, prompt: str, needles: list[str], template: str) -> dict[str, Any]:
    """Character spans of each needle in ``prompt`` and the index of the token where each starts."""
    spans = []
    start = 0
    for needle in needles:
        at = prompt.find(needle, start)
        if at < 0:
            at = prompt.find(needle)
        spans.append((at, at + len(needle)))
        start = at + 1 if at >= 0 else start
    out: dict[str, Any] = {"needles": list(needles), "needle_spans": spans}
    try:
        offsets = _encode(tokenizer, prompt, template, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        return out  # slow tokenizers have no offsets
    positions = []
    for at, _ in spans:
        token = next((i for i, (s, e) in enumerate(offsets) if e > at and e > s), None) if at >= 0 else None
        positions.append(token)
    out["needle_token_positions"] = positions
    return out


TASKS: Registry[Task] = Registry("task", Task)
register_task = TASKS.register
