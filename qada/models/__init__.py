"""The transformers wrapper and model loading."""

from qada.models.apply import apply, enable, register_attention
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
    "enable",
    "load_default_model",
    "load_model",
    "register_attention",
]
