"""Attention executors: compute one decode step given the per-head local/dense decision.

Importing this package registers the built-in executors in :data:`EXECUTORS` (cheap: no triton import, no
compilation; those happen on an executor's first call).
"""

from qada.attention.auto import AutoExecutor
from qada.attention.base import (
    EXECUTORS,
    AttentionExecutor,
    ExecutorOutput,
    GroupDecision,
    decode_attention,
    register_executor,
)
from qada.attention.flex import FlexExecutor
from qada.attention.fused import FusedTritonExecutor
from qada.attention.group_policy import GROUP_POLICIES, apply_group_policy, check_group_policy
from qada.attention.reference import ReferenceExecutor
from qada.attention.sdpa import SDPAExecutor
from qada.attention.triton_decode import TritonExecutor, check_triton_runtime

__all__ = [
    "EXECUTORS",
    "GROUP_POLICIES",
    "AttentionExecutor",
    "AutoExecutor",
    "ExecutorOutput",
    "FlexExecutor",
    "FusedTritonExecutor",
    "GroupDecision",
    "ReferenceExecutor",
    "SDPAExecutor",
    "TritonExecutor",
    "apply_group_policy",
    "check_group_policy",
    "check_triton_runtime",
    "decode_attention",
    "register_executor",
]
