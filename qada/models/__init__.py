"""The transformers wrapper and model loading."""

from qada.models.apply import apply, attach, build_run, enable, prepare_run, register_attention
from qada.models.guards import CacheGuard, StaleStateError, UnsupportedModelError
from qada.models.loading import load_default_model, load_model
from qada.models.observers import DecisionEvent, DecisionRecorder, Observer, ObserverFanout
from qada.models.run import QAdARun
from qada.models.statistics import DecodeStatistics

__all__ = [
    "CacheGuard",
    "DecodeStatistics",
    "DecisionEvent",
    "DecisionRecorder",
    "Observer",
    "ObserverFanout",
    "QAdARun",
    "StaleStateError",
    "UnsupportedModelError",
    "apply",
    "attach",
    "build_run",
    "enable",
    "load_default_model",
    "load_model",
    "prepare_run",
    "register_attention",
]
