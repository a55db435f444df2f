"""``MegaMoERoutedExperts``: torchtitan's routed-expert region, computed by megamoe.

It is a :class:`torchtitan.models.common.moe.RoutedExperts` whose forward runs dispatch, the
expert GEMMs and combine as one megamoe call. It keeps both children of the native module:
``inner_experts`` (the ``GroupedExperts`` that owns ``w1_EFD``, ``w3_EFD`` and ``w2_EDF``) and
``token_dispatcher`` (built but unused), so parameter names, state-dict keys, the EP ``S(0)``
sharding of the expert weights, FSDP's ``moe.routed_experts.inner_experts`` lookup and the FLOP
count are those of the native model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.protocols.module import Module

from megamoe import ops
from megamoe.backends import BACKENDS, precision_reason
from megamoe.backends.fp8_weights import gathered_per_call
from megamoe.config import PRECISIONS, MoEConfig
from megamoe.types import ExpertWeights
from megamoe.validation import group_size_rank

__all__ = ["MegaMoERoutedExperts", "BACKEND_CHOICES", "COMPUTE_DTYPES", "OPTION_FIELDS"]

BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKENDS)
# The dtype the experts compute in; x and the weights are cast to it (GroupedExperts computes in
# bfloat16 whatever the parameters' dtype). float32: the reference backend only (CPU, debugging).
COMPUTE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# The MoEConfig fields a user may set: everything but the layer's shape, which comes from the
# model (tunables, block_rows, capacity_factor; docs/tuning.md).
_SHAPE_FIELDS = frozenset(
    {"hidden_size", "intermediate_size", "num_experts", "top_k", "shared_intermediate_size"}
)
OPTION_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(MoEConfig) if f.name not in _SHAPE_FIELDS
)


def check_options(backend: Any, compute_dtype: Any, check_values: Any, tunables: Any) -> None:
    """Refuse a bad option with an error naming it, its value and what is accepted (at config
    time, before anything is built)."""
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {list(BACKEND_CHOICES)}, got {backend!r}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, got {compute_dtype!r}"
        )
    if compute_dtype == "float32" and backend != "reference":
        raise ValueError(
            f"compute_dtype='float32' runs on backend 'reference' only (the Triton kernels "
            f"compute in bfloat16), got backend={backend!r}"
        )
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values must be a bool, got {check_values!r}")
    if not isinstance(tunables, dict):
        raise TypeError(f"tunables must be a dict, got {type(tunables).__name__}")
    unknown = sorted(set(tunables) - set(OPTION_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown megamoe option(s) {unknown}: the accepted tunables are "
            f"{list(OPTION_FIELDS)} (the layer's shape comes from the model)"
        )
    precision = tunables.get("precision", "bf16")
    if backend != "auto" and precision in PRECISIONS:  # (a bad name: MoEConfig says so)
        reason = precision_reason(backend, precision)
        if reason is not None:
            raise ValueError(reason)


def moe_config(
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    shared_intermediate_size: int,
    tunables: dict[str, Any],
) -> MoEConfig:
    """The megamoe config of one layer (MoEConfig validates every value, by name)."""
    return MoEConfig(
        hidden_size,
        intermediate_size,
        num_experts,
        top_k,
        shared_intermediate_size=shared_intermediate_size,
        **tunables,
    )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard: DTensor parameters (the DTensor SPMD backends) as their local
    tensor, plain ones (the spmd_types backend, or no parallelism) as they are."""
    return t.to_local() if isinstance(t, DTensor) else t


def ep_group_of(parallel_dims: Any) -> dist.ProcessGroup | None:
    """The expert-parallel process group of torchtitan's mesh (None when EP is off)."""
    mesh = parallel_dims.get_optional_mesh("ep")
    return None if mesh is None else mesh.get_group()


class MegaMoERoutedExperts(RoutedExperts):
    """Routed experts through megamoe (``megamoe.ops.moe``), same parameters as native.

    Forward: ``(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E) ->
    out_BLD``, the shape and dtype of ``x_BLD``, ``out[t] = sum_k score[t,k] *
    expert_{id[t,k]}(x[t])`` with ``expert(x) = w2 @ (silu(w1 @ x) * (w3 @ x))`` (ids are global;
    the counts are not needed). x and the weights are cast to ``compute_dtype`` (bfloat16: what
    ``GroupedExperts`` computes in); the scores go in as float32.

    Expert parallelism: :meth:`parallelize` takes the group of torchtitan's ``ep`` mesh (or call
    :meth:`set_ep_group` when driving the module by hand); each rank passes its own tokens and
    owns ``num_experts / EP`` consecutive experts (the EP ``S(0)`` sharding of ``inner_experts``),
    megamoe moves the tokens. The token dispatcher is not used, and not wired to the mesh (a
    DeepEP or MinimalAsyncEP dispatcher allocates no buffers).

    Config fields on top of ``RoutedExperts.Config``: ``backend`` ("auto", "triton", "fused",
    "reference"), ``compute_dtype`` ("bfloat16", or "float32" with backend "reference"),
    ``check_values`` (the input checks that read the device; skipped in compiled code and under
    CUDA-graph capture) and ``tunables`` (``MoEConfig`` fields other than the shape:
    :data:`OPTION_FIELDS`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        backend: str = "auto"
        compute_dtype: str = "bfloat16"
        check_values: bool = True
        tunables: dict[str, Any] = field(default_factory=dict)

        def __post_init__(self) -> None:
            check_options(self.backend, self.compute_dtype, self.check_values, self.tunables)
            experts, dispatcher = self.inner_experts, self.token_dispatcher
            # the layer's shape, validated now (an error here names the bad tunable)
            moe_config(
                experts.dim,
                experts.hidden_dim,
                experts.num_experts,
                dispatcher.top_k,
                0,
                self.tunables,
            )
            if dispatcher.num_experts != experts.num_experts:
                raise ValueError(
                    f"token_dispatcher.num_experts ({dispatcher.num_experts}) must equal "
                    f"inner_experts.num_experts ({experts.num_experts})"
                )

    def __init__(self, config: Config):
        super().__init__(config)
        self.backend = config.backend
        self.compute_dtype = COMPUTE_DTYPES[config.compute_dtype]
        self.check_values = config.check_values
        self.tunables = dict(config.tunables)
        self.top_k = config.token_dispatcher.top_k
        self.num_experts = config.inner_experts.num_experts  # global
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        self._world_size = 1
        # (local weight shapes, world size, shared size) -> (MoEConfig, the same without the fp8
        # weight cache: weights gathered or cast per call); filled eagerly (here, in
        # set_ep_group) so that a compiled forward only looks it up
        self._configs: dict[tuple, tuple[MoEConfig, MoEConfig]] = {}
        self._remember_config(self._expected_key(0))
        # FSDP (torchtitan's apply_fsdp makes inner_experts a unit of its own) gathers the
        # expert weights around inner_experts' forward and reduce-scatters their gradients after
        # its backward: the megamoe call runs as that forward, so FSDP's hooks frame it.
        self.inner_experts.forward = self._experts_call

    # -- expert parallelism -------------------------------------------------------------------

    def parallelize(self, parallel_dims: Any) -> None:
        """Shard the expert weights as native (``Module.parallelize`` of the children and of
        this region's local_map), then take the EP group of the mesh for megamoe. The token
        dispatcher stays unwired: megamoe does the dispatch."""
        Module.parallelize(self, parallel_dims)
        self.set_ep_group(ep_group_of(parallel_dims))

    def set_ep_group(self, group: dist.ProcessGroup | None) -> None:
        """Use ``group`` as the expert-parallel group (None: one process owns every expert).
        ``inner_experts`` must then hold this rank's ``num_experts / world_size`` experts."""
        world_size, _ = group_size_rank(group)
        if self.num_experts % world_size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by the expert-parallel "
                f"world size, got {world_size}"
            )
        self._group = group
        self._group_name = ops.group_key(group)
        self._world_size = world_size
        self._remember_config(self._expected_key(0))

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self._group

    # -- the megamoe config -------------------------------------------------------------------

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inner = self.inner_experts
        return local_tensor(inner.w1_EFD), local_tensor(inner.w3_EFD), local_tensor(inner.w2_EDF)

    def _expected_key(self, shared_intermediate_size: int) -> tuple:
        w1, _, w2 = self._local_weights()
        return (tuple(w1.shape), tuple(w2.shape), self._world_size, shared_intermediate_size)

    def _remember_config(self, key: tuple) -> tuple[MoEConfig, MoEConfig]:
        (e_local, inter, hidden), w2_shape, world_size, shared = key
        if w2_shape != (e_local, hidden, inter):
            raise ValueError(
                f"inner_experts.w2_EDF must have shape {[e_local, hidden, inter]} (the local "
                f"w1_EFD is {[e_local, inter, hidden]}), got {list(w2_shape)}"
            )
        if e_local * world_size != self.num_experts:
            raise ValueError(
                f"inner_experts holds {e_local} experts on each of {world_size} expert-parallel "
                f"rank(s), but the layer has num_experts={self.num_experts}: the local expert "
                f"weights must be num_experts / EP = {self.num_experts // world_size} experts "
                f"(torchtitan's EP S(0) sharding)"
            )
        cfg = moe_config(hidden, inter, self.num_experts, self.top_k, shared, self.tunables)
        self._configs[key] = (cfg, dataclasses.replace(cfg, fp8_weight_cache=False))
        return self._configs[key]

    def megamoe_config(
        self, shared_intermediate_size: int = 0, transient: bool = False
    ) -> MoEConfig:
        """The ``MoEConfig`` the next forward uses (local weight shapes, EP world size);
        ``transient``: the weights are gathered (FSDP) or cast anew for the call, so their fp8
        copies are not cached (``MoEConfig.fp8_weight_cache``)."""
        key = self._expected_key(shared_intermediate_size)
        configs = self._configs.get(key)
        if configs is not None:
            return configs[transient]
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"megamoe: the expert weights changed shape to {key[:2]} after the module was "
                f"built or parallelized; run one eager forward first, or call set_ep_group() "
                f"again"
            )
        return self._remember_config(key)[transient]

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        del num_local_tokens_per_expert_E  # megamoe counts the rows itself, on the device
        return self.compute(x_BLD, topk_scores_BLK, topk_expert_ids_BLK)

    def compute(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The megamoe call on local tensors; ``shared`` = the shared expert's ``(w1, w3, w2)``
        weights (``nn.Linear`` layouts ``[Is, D], [Is, D], [D, Is]``), added in the same call."""
        if x_BLD.dim() != 3:
            raise ValueError(f"x_BLD must be a 3-D (B, L, D) tensor, got {list(x_BLD.shape)}")
        B, L, D = x_BLD.shape
        T, K = B * L, self.top_k
        if tuple(topk_expert_ids_BLK.shape) != (B, L, K):
            raise ValueError(
                f"topk_expert_ids_BLK must have shape {[B, L, K]}, got "
                f"{list(topk_expert_ids_BLK.shape)}"
            )
        if tuple(topk_scores_BLK.shape) != (B, L, K):
            raise ValueError(
                f"topk_scores_BLK must have shape {[B, L, K]}, got {list(topk_scores_BLK.shape)}"
            )
        dt = self.compute_dtype
        y_TD = self.inner_experts(
            x_BLD.reshape(T, D).to(dt).contiguous(),
            topk_expert_ids_BLK.reshape(T, K),
            topk_scores_BLK.reshape(T, K).float(),
            shared,
        )
        return y_TD.to(x_BLD.dtype).view(B, L, D)

    def _experts_call(
        self,
        x_TD: torch.Tensor,
        ids_TK: torch.Tensor,
        scores_TK: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """``inner_experts``' forward: the megamoe call on its weights as they are now (FSDP
        has gathered them by then)."""
        dt = self.compute_dtype
        local, shared_local = self._local_weights(), shared or ()
        # gathered by FSDP or cast below: new for this call (their fp8 copies are not cached)
        transient = (
            gathered_per_call(self.inner_experts)
            or gathered_per_call(self)
            or any(w.dtype != dt for w in (*local, *shared_local))
        )
        w1, w3, w2 = (w.to(dt) for w in local)
        s = (None, None, None) if shared is None else tuple(w.to(dt) for w in shared)
        cfg = self.megamoe_config(0 if shared is None else s[0].shape[0], transient)
        return ops.moe(
            x_TD,
            ids_TK,
            scores_TK,
            ExpertWeights(w1, w3, w2, *s),
            cfg,
            group=self._group,
            backend=self.backend,
            check_values=self.check_values,
            group_name=self._group_name,
        )

    def extra_repr(self) -> str:
        dt = str(self.compute_dtype).replace("torch.", "")
        return (
            f"backend={self.backend!r}, compute_dtype={dt}, ep_world_size={self._world_size}, "
            f"tunables={self.tunables}"
        )
