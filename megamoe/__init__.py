"""megamoe: a fused, deterministic, expert-parallel Mixture-of-Experts layer for PyTorch on Hopper.

Public API: :class:`MoEConfig`, :class:`MoE`, :class:`TopKRouter`, :mod:`megamoe.functional`.
"""

from . import functional
from .config import PRESETS, MoEConfig, get_preset
from .layer import MoE, TopKRouter
from .types import ExpertWeights, MoEGrads

__version__ = "0.1.0"

__all__ = ["MoEConfig", "MoE", "TopKRouter", "ExpertWeights", "MoEGrads", "functional",
           "PRESETS", "get_preset", "__version__"]
