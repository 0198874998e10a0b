"""Head criteria: which heads may use the local window at this decode step.

Importing this package registers the built-in criteria in :data:`CRITERIA`.
"""

from qada.criteria.base import CRITERIA, HeadCriterion, register_criterion
from qada.criteria.baselines import DenseCriterion, LocalCriterion
from qada.criteria.budget import BudgetCriterion, spread_count, top_k_mask
from qada.criteria.budgeted import BudgetedQAdACriterion
from qada.criteria.calibrated import CalibratedQAdACriterion
from qada.criteria.calibration import StaticCalibrator
from qada.criteria.compose import AllOf, AnyOf, CompositeCriterion, LayerOverride, Not
from qada.criteria.hybrid import HybridCriterion
from qada.criteria.oracle import OracleCriterion
from qada.criteria.qada import QAdACriterion
from qada.criteria.quest import QuestCriterion
from qada.criteria.static import StaticCriterion
from qada.criteria.tail import READ_LEAN, TailBudgetCriterion, TailCriterion
from qada.criteria.threshold import ThresholdCriterion
from qada.step import DecodeStep, StepContext

__all__ = [
    "CRITERIA",
    "READ_LEAN",
    "AllOf",
    "AnyOf",
    "BudgetCriterion",
    "BudgetedQAdACriterion",
    "CalibratedQAdACriterion",
    "CompositeCriterion",
    "DecodeStep",
    "DenseCriterion",
    "HeadCriterion",
    "HybridCriterion",
    "LayerOverride",
    "LocalCriterion",
    "Not",
    "OracleCriterion",
    "QAdACriterion",
    "QuestCriterion",
    "StaticCalibrator",
    "StaticCriterion",
    "StepContext",
    "TailBudgetCriterion",
    "TailCriterion",
    "ThresholdCriterion",
    "register_criterion",
    "spread_count",
    "top_k_mask",
]
