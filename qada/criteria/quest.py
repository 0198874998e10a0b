"""Quest (Tang et al., 2024) as a baseline: every head attends to its window plus the top pages of the current
query, ranked by an upper bound on their scores from each page's key extrema (issue 32).

Per KV head the cache is cut into pages of ``P`` slots whose elementwise key minimum and maximum are kept (the page
machinery of the tail-aware criteria, :mod:`qada.functional.tail`); per query head and step the ``k`` bulk pages
with the highest bound ``sum_d max(q_d kmin_d, q_d kmax_d)`` are attended besides the window
(:mod:`qada.functional.extra_set`). No head is ever dense: the criterion decides *what* a head reads, not *whether*.

Reads per KV head and step (``kv_read``): the window's keys and values, two extrema per page holding a token of the
row, and the keys and values of the ``G k P`` page tokens of its ``G`` query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.criteria.base import HeadCriterion, register_criterion
from qada.criteria.tail import TailEstimate
from qada.criteria.tail_index import append_step_key
from qada.functional.capping import soft_cap
from qada.step import DecodeStep

__all__ = ["QuestCriterion"]


@register_criterion("quest")
@dataclass
class QuestCriterion(TailEstimate, HeadCriterion):
    """Every head local, attending over its window and its query's top ``pages`` pages of ``page_size`` slots.

    Args:
        pages: pages per query head and step (``k``).
        page_size: slots per page (``P``).
        budget: a token budget instead of ``pages``: ``pages = max(1, budget // page_size)``.
    """

    pages: int = 16
    page_size: int = 16
    budget: int | None = None
    heavy: int = 0
    observe: int = 0
    attend_exact: bool = True

    def __post_init__(self) -> None:
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 1):
            raise ValueError(f"expected budget to be a positive int (tokens) but got {self.budget!r}")
        if self.heavy or not self.attend_exact:
            raise ValueError("quest attends over its pages only: heavy must be 0 and attend_exact True")
        self._check_tail()
        if self.budget is not None:
            self.pages = max(1, self.budget // self.page_size)
        if self.pages < 1:
            raise ValueError(f"expected pages >= 1 but got {self.pages!r}")

    def decide(self, step: DecodeStep) -> torch.Tensor:
        append_step_key(self.state(step), step.keys, step.end, self.page_size, self.super_page)
        scores, valid, slots = self.exact_set_slots(step)
        step.attend_also(slots, valid, soft_cap(scores, step.softcap))
        return torch.ones(step.batch_size, step.num_heads, dtype=torch.bool, device=step.device)
