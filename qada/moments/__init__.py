"""Moment sources: where the bulk key moments ``mu_K, Sigma_K`` of QAdA come from."""

from qada.moments.types import BulkMoments

__all__ = ["BulkMoments"]
