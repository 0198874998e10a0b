"""Variable tracking (``vt``), RULER's ``variable_tracking.py``: follow a chain of ``VAR X = VAR Y`` assignments.

A chain ``VAR A = 12345, VAR B = VAR A, ...`` of ``num_hops + 1`` variables is hidden between repeated noise
lines; the answer is every variable that ends up holding the number. As in RULER, the prompt starts with
one solved example (built once per call at about 500 tokens with 3-letter names, its answer names
re-randomised for each sample).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from qada.eval.tasks.base import Built, Task, format_prompt, register_task, sample_rng
from qada.eval.tasks.templates import TASK_TEMPLATES, VT_NOISE

__all__ = ["VariableTrackingTask"]

_T = TASK_TEMPLATES["variable_tracking"]
ICL_TOKENS = 500  # RULER's max_seq_length for the example, generation budget included


@dataclass
class VariableTrackingTask(Task):
    """``num_chains`` chains of ``num_hops`` hops; ``size`` counts noise lines. ``few_shot`` adds RULER's example."""

    num_chains: int = 1
    num_hops: int = 4
    few_shot: bool = True
    template: str = "base"
    _example: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    tokens_to_generate = _T["tokens_to_generate"]

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_chains", "num_hops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} >= 1 but got {value!r}")

    def size_range(self, length: int) -> tuple[int, int]:
        return 1, length + 16

    def _chains(self, rng: random.Random, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        k = 3 if is_icl else 5
        hops = min(10, self.num_hops) if is_icl else self.num_hops
        n = (hops + 1) * self.num_chains
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range(n)]
        while len(set(names)) < n:
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
        variables, chains = [], []
        for i in range(0, len(names), hops + 1):
            this = names[i : i + hops + 1]  # as RULER: consecutive slices (duplicates kept as drawn)
            variables.append(this)
            chain = [f"VAR {this[0]} = {rng.randint(10000, 99998)}"]
            chain += [f"VAR {this[j + 1]} = VAR {this[j]} " for j in range(hops)]
            chains.append(chain)
        return variables, chains

    def _text(self, rng: random.Random, size: int, is_icl: bool) -> tuple[str, str, list[str], list[str]]:
        """``(task text, answer prefix, answer variables, chain statements)``."""
        variables, chains = self._chains(rng, is_icl)
        sentences = [VT_NOISE] * size
        if len(sentences) <= len(chains[0]):  # RULER: too little noise, split it into sentences
            sentences = [n + "." if n.strip() else n for noise in sentences for n in noise.split(".")]
            if len(sentences) <= len(chains[0]):
                chains = [chain[: len(sentences) - 1] for chain in chains]
        for chain in chains:
            positions = sorted(rng.sample(range(len(sentences)), len(chain)))
            for j, position in enumerate(positions):
                sentences.insert(position + j, chain[j])
        context = " ".join(sentences).replace(". \n", ".\n")
        value = chains[0][0].split("=")[-1].strip()
        hops = min(10, self.num_hops) if is_icl else self.num_hops
        text = _T["template"].format(context=context, query=value, num_v=hops + 1)
        prefix = _T["answer_prefix"].format(context=context, query=value, num_v=hops + 1)
        statements = [s.strip() for chain in chains for s in chain]
        return text, prefix, variables[0], statements

    def prepare(self, tokenizer, length: int, seed: int) -> None:
        """RULER's solved example: the most noise that fits 500 tokens with its answer and 30 to generate."""
        self._example = {}
        if not self.few_shot:
            return

        def example(size: int) -> tuple[str, int]:
            text, prefix, answer, _ = self._text(sample_rng(seed, -1, "vt-icl"), size, is_icl=True)
            full = format_prompt(tokenizer, text, prefix, "base") + " " + " ".join(answer)
            return full, len(tokenizer(full)["input_ids"]) + self.tokens_to_generate

        good, bad = 1, 64
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if example(mid)[1] <= ICL_TOKENS else (good, mid)
        full, _ = example(good)
        self._example = {"text": full + "\n\n", "answer": full.rsplit(_T["answer_prefix"][-10:], 1)[1].split()}

    def build(self, rng: random.Random, size: int, length: int, index: int = 0) -> Built:
        text, prefix, answer, statements = self._text(rng, size, is_icl=False)
        if self._example:
            example = self._example["text"]
            for name in self._example["answer"]:  # RULER's randomize_icl
                example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
            text = " " + example + "\n\n" + text
        return Built(text=text, outputs=answer, answer_prefix=prefix, needles=statements)


register_task("vt")(VariableTrackingTask)
