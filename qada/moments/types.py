"""Containers for bulk key moments (defined with the decode step, :mod:`qada.step`, which consumes them)."""

from qada.step import BulkMoments

__all__ = ["BulkMoments"]
