"""Needle in a haystack, RULER's ``niah.py``: every variant of ``synthetic.yaml`` is a registered task.

Needles ``"One of the special magic {type_needle_v} for {key} is: {value}."`` are hidden in a haystack of
essay text (inserted between sentences at depths drawn from 40 evenly spaced percentages), of one repeated
noise paragraph, or of distractor needles (both: inserted between lines). The question asks for the values
of ``num_needle_q`` of the ``num_needle_k`` keys; each key has ``num_needle_v`` values.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from qada.eval.tasks.base import Built, Task, register_task
from qada.eval.tasks.data import adjectives_and_nouns, essay_words, split_sentences
from qada.eval.tasks.templates import NIAH_NEEDLE, REPEAT_HAYSTACK, TASK_TEMPLATES

__all__ = ["NiahTask"]

HAYSTACKS = ("essay", "repeat", "needle", "noise")  # "noise" is an alias of RULER's "repeat"
NEEDLE_TYPES_K = ("words", "numbers", "uuids")
NEEDLE_TYPES_V = ("words", "numbers", "uuids")
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, num=40))


def random_needle(rng: random.Random, kind: str) -> str:
    """A 7-digit number, an ``adjective-noun`` word pair or a UUID4, as RULER draws them."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjectives, nouns = adjectives_and_nouns()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"expected a needle type in {list(NEEDLE_TYPES_V)} but got {kind!r}")


@dataclass
class NiahTask(Task):
    """A niah variant; the defaults are ``niah_single_2``. ``size`` counts words (essay) or lines."""

    type_haystack: str = "essay"
    type_needle_k: str = "words"
    type_needle_v: str = "numbers"
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1
    template: str = "base"

    tokens_to_generate = TASK_TEMPLATES["niah"]["tokens_to_generate"]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.type_haystack not in HAYSTACKS:
            raise ValueError(f"expected type_haystack in {list(HAYSTACKS)} but got {self.type_haystack!r}")
        for name, allowed in (("type_needle_k", NEEDLE_TYPES_K), ("type_needle_v", NEEDLE_TYPES_V)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"expected {name} in {list(allowed)} but got {getattr(self, name)!r}")
        for name in ("num_needle_k", "num_needle_v", "num_needle_q"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} >= 1 but got {value!r}")

    @property
    def num_keys(self) -> int:
        return max(self.num_needle_k, self.num_needle_q)  # as RULER: at least as many keys as queries

    def size_range(self, length: int) -> tuple[int, int]:
        if self.type_haystack == "essay":
            return 16, min(len(essay_words()), 2 * length + 16)
        return self.num_keys * self.num_needle_v, length + 16

    def context(self, rng: random.Random, size: int) -> tuple[str, list[str], list[str], list[str]]:
        """``(context, needles, queried keys, answers)`` with a haystack of ``size`` words or lines."""
        keys, values, needles = [], [], []
        for _ in range(self.num_keys):
            keys.append(random_needle(rng, self.type_needle_k))
            value = []
            for _ in range(self.num_needle_v):
                value.append(random_needle(rng, self.type_needle_v))
                needles.append(NIAH_NEEDLE.format(type_needle_v=self.type_needle_v, key=keys[-1], value=value[-1]))
            values.append(value)
        rng.shuffle(needles)

        if self.type_haystack == "essay":
            sentences = split_sentences(" ".join(essay_words()[:size]))
            depths = sorted(rng.sample(DEPTHS, len(needles)))
            cuts = [0] + [int(len(sentences) * (d / 100)) for d in depths] + [len(sentences)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sentences[cuts[i - 1] : cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if self.type_haystack in ("repeat", "noise"):
                lines = [REPEAT_HAYSTACK] * size
            else:
                lines = [
                    NIAH_NEEDLE.format(
                        type_needle_v=self.type_needle_v,
                        key=random_needle(rng, self.type_needle_k),
                        value=random_needle(rng, self.type_needle_v),
                    )
                    for _ in range(size)
                ]
            for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles, strict=True):
                lines.insert(index, needle)
            context = "\n".join(lines)

        chosen = rng.sample(range(self.num_keys), self.num_needle_q)
        queries = [keys[i] for i in chosen]
        answers = [a for i in chosen for a in values[i]]
        return context, needles, queries, answers

    def build(self, rng: random.Random, size: int, length: int, index: int = 0) -> Built:
        context, needles, queries, answers = self.context(rng, size)
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template = TASK_TEMPLATES["niah"]["template"]
        prefix = TASK_TEMPLATES["niah"]["answer_prefix"]
        type_needle_v = self.type_needle_v
        if self.num_needle_q * self.num_needle_v == 1:  # RULER's singular wording, on template + prefix
            template, prefix = (_singular(t) for t in (template, prefix))
            type_needle_v = type_needle_v[:-1]
        return Built(
            text=template.format(type_needle_v=type_needle_v, context=context, query=query),
            outputs=answers,
            answer_prefix=prefix.format(type_needle_v=type_needle_v, query=query),
            needles=needles,
            metadata={"queries": queries},
        )


def _singular(template: str) -> str:
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template


# RULER's synthetic.yaml ("repeat" is RULER's name for the noise haystack).
_VARIANTS = {
    "niah_single_1": dict(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers"),
    "niah_single_2": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers"),
    "niah_single_3": dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids"),
    "niah_multikey_1": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_k=4),
    "niah_multikey_2": dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers"),
    "niah_multikey_3": dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids"),
    "niah_multivalue": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_v=4),
    "niah_multiquery": dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_q=4),
}


def _variant(name: str, defaults: dict) -> type[NiahTask]:
    fields = {k: v for k, v in defaults.items()}
    namespace = {"__annotations__": {k: type(v) for k, v in fields.items()}, **fields, "__module__": __name__}
    cls = dataclass(type(f"Niah_{name}", (NiahTask,), namespace))
    cls.__doc__ = f"RULER's ``{name}``: NiahTask with {defaults}."
    return register_task(name)(cls)


for _name, _defaults in _VARIANTS.items():
    _variant(_name, _defaults)

register_task("niah")(NiahTask)
