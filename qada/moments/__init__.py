"""Moment sources: where the bulk key moments ``mu_K, Sigma_K`` of QAdA come from."""

from qada.moments.base import MOMENT_SOURCES, MomentSource, register_moment_source
from qada.moments.current import CurrentMoments
from qada.moments.math import MomentState
from qada.moments.types import BulkMoments

__all__ = [
    "MOMENT_SOURCES",
    "BulkMoments",
    "CurrentMoments",
    "MomentSource",
    "MomentState",
    "register_moment_source",
]
