"""qada: query-adaptive long-context head identification for cheaper long-context decoding."""

from qada.criteria import CRITERIA, HeadCriterion, StepContext, register_criterion
from qada.models import apply, enable, load_default_model, load_model
from qada.registry import Component, Registry, load_config
from qada.step import DecodeStep
from qada.version import __version__
from qada.window import Window

__all__ = [
    "CRITERIA",
    "Component",
    "DecodeStep",
    "HeadCriterion",
    "Registry",
    "StepContext",
    "Window",
    "__version__",
    "apply",
    "enable",
    "load_default_model",
    "load_model",
    "load_config",
    "register_criterion",
]
