"""Head criteria: which heads may use the local window at this decode step.

Importing this package registers the built-in criteria in :data:`CRITERIA`.
"""

from qada.criteria.base import CRITERIA, HeadCriterion, register_criterion
from qada.criteria.baselines import DenseCriterion, LocalCriterion
from qada.criteria.calibration import StaticCalibrator
from qada.criteria.compose import AllOf, AnyOf, LayerOverride, Not
from qada.criteria.context import StepContext
from qada.criteria.oracle import OracleCriterion
from qada.criteria.qada import QAdACriterion
from qada.criteria.static import StaticCriterion

__all__ = [
    "CRITERIA",
    "AllOf",
    "AnyOf",
    "DenseCriterion",
    "HeadCriterion",
    "LayerOverride",
    "LocalCriterion",
    "Not",
    "OracleCriterion",
    "QAdACriterion",
    "StaticCalibrator",
    "StaticCriterion",
    "StepContext",
    "register_criterion",
]
