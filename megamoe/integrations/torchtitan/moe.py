"""``MegaMoEMoE``: torchtitan's MoE layer with the routed experts and the shared expert in one
megamoe call.

The router, the aux-loss-free balancing state (``expert_bias_E``, ``tokens_per_expert_E``,
``load_balance_coeff``) and every child keep their names, so state-dict keys, FSDP's lookup of
``moe.routed_experts.inner_experts`` and torchtitan's balancing hook are those of the native
layer; the shared expert's ``w1/w3/w2`` weights are megamoe's ``s_gate/s_up/s_down``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import MoE

from .experts import MegaMoERoutedExperts, local_tensor

__all__ = ["MegaMoEMoE"]


class MegaMoEMoE(MoE):
    """MoE whose forward is: router -> token counts (balancing) -> one megamoe call for the
    routed experts plus the shared expert (when the config has one).

    Supported: expert parallelism and FSDP with the "spmd_types" (torchtitan's default) and
    "partial_dtensor" SPMD backends, without tensor parallelism; :meth:`parallelize` refuses
    the rest (use the ``megamoe_routed_experts`` override there: it keeps the shared expert
    native).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        def __post_init__(self) -> None:
            if not isinstance(self.routed_experts, MegaMoERoutedExperts.Config):
                raise TypeError(
                    f"MegaMoEMoE.Config.routed_experts must be a MegaMoERoutedExperts.Config, "
                    f"got {type(self.routed_experts).__qualname__}"
                )
            shared = self.shared_experts
            if shared is None:
                return
            if type(shared) is not FeedForward.Config:
                raise TypeError(
                    f"megamoe runs a shared expert that is torchtitan's SwiGLU FeedForward, got "
                    f"{type(shared).__qualname__}"
                )
            dim = self.routed_experts.inner_experts.dim
            for name in ("w1", "w2", "w3"):
                lin = getattr(shared, name)
                if type(lin) is not Linear.Config:
                    raise TypeError(
                        f"shared_experts.{name} must be a plain Linear.Config, got "
                        f"{type(lin).__qualname__}"
                    )
                if lin.bias:
                    raise ValueError(
                        f"megamoe's shared expert has no biases, got shared_experts.{name} "
                        f"with bias=True"
                    )
            if shared.w1.in_features != dim or shared.w2.out_features != dim:
                raise ValueError(
                    f"shared_experts must map dim {dim} to dim {dim}, got w1.in_features="
                    f"{shared.w1.in_features}, w2.out_features={shared.w2.out_features}"
                )

    def parallelize(self, parallel_dims: Any) -> None:
        if parallel_dims.tp > 1:
            raise NotImplementedError(
                f"the megamoe_moe override does not support tensor parallelism (got "
                f"tensor_parallel_degree={parallel_dims.tp}); use megamoe_routed_experts, which "
                f"keeps the shared expert native"
            )
        if parallel_dims.spmd_backend == "full_dtensor":
            raise NotImplementedError(
                "the megamoe_moe override supports parallelism.spmd_backend 'spmd_types' and "
                "'partial_dtensor', got 'full_dtensor'; use megamoe_routed_experts there"
            )
        super().parallelize(parallel_dims)

    def _shared_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        ffn = self.shared_experts
        if ffn is None:
            return None
        return tuple(local_tensor(lin.weight) for lin in (ffn.w1, ffn.w3, ffn.w2))

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = self.router(x_BLD, self.expert_bias_E)
        for name, t in (("x_BLD", x_BLD), ("topk_scores_BLK", topk_scores_BLK)):
            if isinstance(t, DTensor):
                raise TypeError(
                    f"MegaMoEMoE runs on local tensors, got a DTensor {name} with placements "
                    f"{t.placements} (an SPMD layout megamoe_moe does not support; use "
                    f"megamoe_routed_experts)"
                )
        # per-expert token counts of this step, for the aux-loss-free balancing hook
        if self.training:
            with torch.no_grad():
                chosen_BLE = torch.zeros_like(scores_BLE, dtype=torch.bool)
                chosen_BLE.scatter_(-1, topk_expert_ids_BLK, True)
                self.tokens_per_expert_E.add_(chosen_BLE.sum(dim=(0, 1)))
        return self.routed_experts.compute(
            x_BLD, topk_scores_BLK, topk_expert_ids_BLK, shared=self._shared_weights()
        )
