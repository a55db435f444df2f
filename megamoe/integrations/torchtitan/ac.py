"""Selective activation checkpointing that keeps megamoe's forward.

torchtitan's ``SelectiveAC`` saves the outputs of a fixed list of ops (matmuls, attention, the
all-to-alls, DeepEP's and HybridEP's dispatch and combine) and recomputes every other op in the
backward. ``megamoe::moe_forward`` is not on that list, so under plain ``SelectiveAC`` the whole
MoE layer (its expert GEMMs and, with EP, its token exchange) runs a second time in the
backward; the result is the same (megamoe is deterministic), the time is not.
``MegaMoESelectiveAC`` adds the op to the save list: its outputs (y and the state its backward
reads) are kept instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.distributed.activation_checkpoint import SelectiveAC

import megamoe.ops  # noqa: F401  (registers torch.ops.megamoe)

__all__ = ["MegaMoESelectiveAC", "megamoe_save_ops"]


def megamoe_save_ops() -> set:
    """The megamoe ops whose outputs a selective-AC policy should save."""
    return {torch.ops.megamoe.moe_forward.default}


class MegaMoESelectiveAC(SelectiveAC):
    """``SelectiveAC`` whose save list also holds ``megamoe::moe_forward``."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return set(SelectiveAC.get_save_ops(self)) | megamoe_save_ops()
