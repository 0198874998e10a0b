"""The transformers wrapper and model loading."""

from qada.models.apply import apply, attach, build_run, enable, prepare_run, register_attention
from qada.models.loading import load_default_model, load_model
from qada.models.observers import DecisionEvent, DecisionRecorder, Observer
from qada.models.run import QAdARun, StaleStateError, UnsupportedModelError

__all__ = [
    "DecisionEvent",
    "DecisionRecorder",
    "Observer",
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
