"""An out-of-tree qada criterion: per row, the ``k`` heads with the highest peak local score are local."""

from dataclasses import dataclass

import torch

from qada.criteria import HeadCriterion, register_criterion


@register_criterion("topk")
@dataclass
class TopKCriterion(HeadCriterion):
    """Per row, the ``k`` heads with the highest peak local score are local, the others dense."""

    k: int = 4

    def decide(self, ctx) -> torch.Tensor:
        peak = ctx.local_scores.amax(-1)  # [b, H]
        top = peak.topk(min(self.k, ctx.num_heads), dim=-1).indices
        return torch.zeros(ctx.batch_size, ctx.num_heads, dtype=torch.bool, device=peak.device).scatter_(-1, top, True)
