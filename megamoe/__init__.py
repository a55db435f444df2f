"""megamoe: a fused, deterministic, expert-parallel Mixture-of-Experts layer for PyTorch on Hopper.

Public API: :class:`MoEConfig`, :class:`MoE`, :class:`TopKRouter`, :mod:`megamoe.functional`,
:mod:`megamoe.optim`.
"""

from . import functional, optim
from .config import MoEConfig
from .errors import CapacityError, RoutingError, StallError
from .layer import MoE, TopKRouter
from .shapes import MODEL_SHAPES, PRESETS, get_model_shape, get_preset
from .types import ExpertWeights, MoEGrads

__version__ = "0.1.0"

__all__ = [
    "MoEConfig",
    "MoE",
    "TopKRouter",
    "ExpertWeights",
    "MoEGrads",
    "functional",
    "optim",
    "CapacityError",
    "RoutingError",
    "StallError",
    "MODEL_SHAPES",
    "get_model_shape",
    "PRESETS",
    "get_preset",
    "__version__",
]
