"""Moment sources: where the bulk key moments ``mu_K, Sigma_K`` of QAdA come from.

``current`` (streamed moments of the current prompt's bulk), ``stored`` (a reference prompt's keys) and
``bucketed`` (a reference prompt's moments on a grid of lengths), all in :data:`MOMENT_SOURCES`.
"""

from qada.moments.base import MOMENT_SOURCES, MomentSource, register_moment_source
from qada.moments.bucketed import BucketedMoments
from qada.moments.current import CurrentMoments
from qada.moments.math import MomentState
from qada.moments.reference import BucketedMomentsData, ReferenceKeys, collect_reference_keys
from qada.moments.stored import StoredMoments, reference_bulk_end
from qada.step import BulkMoments

__all__ = [
    "MOMENT_SOURCES",
    "BucketedMoments",
    "BucketedMomentsData",
    "BulkMoments",
    "CurrentMoments",
    "MomentSource",
    "MomentState",
    "ReferenceKeys",
    "StoredMoments",
    "collect_reference_keys",
    "reference_bulk_end",
    "register_moment_source",
]
