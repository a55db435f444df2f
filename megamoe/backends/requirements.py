"""What the Triton kernels need: a Hopper GPU, bfloat16 and TMA-aligned sizes.

Shared by backends "triton" and "fused" (``is_available`` / ``supports`` of the backend
interface): ``backend="auto"`` falls back to "reference" where an answer is no.
"""

from __future__ import annotations

import torch

from ..config import MoEConfig
from ..kernels.runtime import device_capability, interpreting

__all__ = [
    "is_available",
    "supports",
    "check_supported",
    "KERNEL_DTYPE",
    "SIZE_MULTIPLE",
    "MIN_CAPABILITY",
]

# Compute capability the kernels are written for (wgmma, TMA).
MIN_CAPABILITY = (9, 0)
KERNEL_DTYPE = torch.bfloat16
# TMA needs 16-byte row strides: sizes must be multiples of this many bf16 elements.
SIZE_MULTIPLE = 8


def is_available(device: torch.device | None = None) -> tuple[bool, str]:
    """CUDA with compute capability >= 9.0 and Triton importable.

    On the CPU the answer is no even under ``TRITON_INTERPRET=1``: the interpreter is far too
    slow for real use and must never be what ``backend="auto"`` picks; tests call the backend
    modules' functions directly there.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        extra = " (the Triton interpreter runs it for tests only)" if interpreting() else ""
        return False, "needs a CUDA GPU with compute capability >= 9.0" + extra
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"needs a CUDA device, got {device}"
    cap = device_capability(device)
    if cap < MIN_CAPABILITY:
        return False, f"needs compute capability >= 9.0 (Hopper), got {cap[0]}.{cap[1]}"
    return True, f"CUDA compute capability {cap[0]}.{cap[1]}"


def supports(config: MoEConfig, dtype: torch.dtype | None) -> tuple[bool, str]:
    """Whether the kernels handle this shape and dtype (``backend="auto"`` falls back if not)."""
    if dtype is not None and dtype != KERNEL_DTYPE:
        return False, f"x must be bfloat16 for the Triton kernels, got {dtype}"
    for name in ("hidden_size", "intermediate_size", "shared_intermediate_size"):
        value = getattr(config, name)
        if value % SIZE_MULTIPLE:
            return False, (
                f"{name} must be a multiple of {SIZE_MULTIPLE} for the Triton kernels "
                f"(TMA row alignment), got {value}"
            )
    return True, "supported"


def check_supported(x: torch.Tensor, config: MoEConfig) -> None:
    """Raise TypeError (dtype) or ValueError (sizes) naming what the kernels cannot take."""
    ok, reason = supports(config, x.dtype)
    if not ok:
        raise (TypeError if x.dtype != KERNEL_DTYPE else ValueError)(reason)
