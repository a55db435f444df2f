"""torchtitan ``@override`` factories that put megamoe into a model's config tree.

Activate one by naming it in ``--override.imports`` (keyword arguments as a JSON object)::

    --override.imports \
      'megamoe.integrations.torchtitan.overrides.megamoe_routed_experts={"backend":"fused"}'

or in Python, ``Trainer.Config(override=OverrideConfig(imports=[(NAME, {"backend": "fused"})]))``
(and ``torchtitan.config.override.apply_overrides`` for a config tree built by hand).

``megamoe_routed_experts``  every ``RoutedExperts.Config`` -> ``MegaMoERoutedExperts.Config``
``megamoe_moe``             every ``MoE.Config`` -> ``MegaMoEMoE.Config`` (the routed experts and
                            the shared expert in one megamoe call); use one of the two, not both
``megamoe_selective_ac``    ``SelectiveAC.Config`` -> ``MegaMoESelectiveAC.Config``: selective
                            activation checkpointing that saves megamoe's forward instead of
                            recomputing it

Keyword arguments of the two expert factories: ``backend`` ("auto", "triton", "fused",
"reference"), ``compute_dtype`` ("bfloat16"; "float32" with backend "reference"),
``check_values`` (bool) and any ``MoEConfig`` tunable by name (``ring_rows``, ``copy_programs``,
``capacity_factor``, ...: :data:`~megamoe.integrations.torchtitan.experts.OPTION_FIELDS`). Every
value is checked when the override is applied, with an error naming it.
"""

from __future__ import annotations

from typing import Any

from torchtitan.config import derive, override
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts

from .ac import MegaMoESelectiveAC
from .experts import MegaMoERoutedExperts
from .moe import MegaMoEMoE

__all__ = ["megamoe_routed_experts", "megamoe_moe", "megamoe_selective_ac", "routed_experts_config"]


def routed_experts_config(
    cfg: RoutedExperts.Config,
    *,
    backend: str = "auto",
    compute_dtype: str = "bfloat16",
    check_values: bool = True,
    **tunables: Any,
) -> MegaMoERoutedExperts.Config:
    """``cfg`` as a ``MegaMoERoutedExperts.Config``: the same children (shared by reference),
    param-init and sharding config, plus megamoe's options."""
    if isinstance(cfg, MegaMoERoutedExperts.Config):
        raise ValueError(
            "this RoutedExperts.Config is already a MegaMoERoutedExperts.Config: apply one "
            "megamoe override once (megamoe_routed_experts or megamoe_moe, not both)"
        )
    if type(cfg) is not RoutedExperts.Config:
        raise TypeError(
            f"megamoe replaces torchtitan's RoutedExperts.Config, got the subclass "
            f"{type(cfg).__qualname__}, whose forward it would drop"
        )
    if type(cfg.inner_experts) is not GroupedExperts.Config:
        raise TypeError(
            f"megamoe computes torchtitan's SwiGLU GroupedExperts (w1_EFD, w3_EFD, w2_EDF), got "
            f"inner_experts of type {type(cfg.inner_experts).__qualname__} (a different "
            f"expert: gpt-oss's, a fused or quantized variant)"
        )
    new = derive(
        cfg,
        MegaMoERoutedExperts.Config,
        backend=backend,
        compute_dtype=compute_dtype,
        check_values=check_values,
        tunables=dict(tunables),
    )
    # derive copies dataclass fields; set both explicitly anyway: the sharding config (set by
    # the model's update_from_config before overrides run) carries the local_map region and the
    # input/output layouts of the native module.
    new.sharding_config = cfg.sharding_config
    new.param_init = cfg.param_init
    return new


@override(
    target=RoutedExperts.Config,
    description="megamoe: routed experts (dispatch, expert GEMMs, combine) in one fused call",
)
def megamoe_routed_experts(
    cfg: RoutedExperts.Config,
    *,
    backend: str = "auto",
    compute_dtype: str = "bfloat16",
    check_values: bool = True,
    **tunables: Any,
) -> MegaMoERoutedExperts.Config:
    return routed_experts_config(
        cfg,
        backend=backend,
        compute_dtype=compute_dtype,
        check_values=check_values,
        **tunables,
    )


@override(
    target=MoE.Config,
    description="megamoe: routed experts and the shared expert in one fused call",
)
def megamoe_moe(
    cfg: MoE.Config,
    *,
    backend: str = "auto",
    compute_dtype: str = "bfloat16",
    check_values: bool = True,
    **tunables: Any,
) -> MegaMoEMoE.Config:
    if isinstance(cfg, MegaMoEMoE.Config):
        raise ValueError("this MoE.Config is already a MegaMoEMoE.Config: apply megamoe_moe once")
    if type(cfg) is not MoE.Config:
        raise TypeError(
            f"megamoe_moe replaces torchtitan's MoE.Config, got the subclass "
            f"{type(cfg).__qualname__}, whose forward it would drop"
        )
    routed = routed_experts_config(
        cfg.routed_experts,
        backend=backend,
        compute_dtype=compute_dtype,
        check_values=check_values,
        **tunables,
    )
    new = derive(cfg, MegaMoEMoE.Config, routed_experts=routed)
    new.sharding_config = cfg.sharding_config
    new.param_init = cfg.param_init
    return new


@override(
    target=SelectiveAC.Config,
    description="megamoe: selective AC that saves megamoe's forward (no recompute, no re-comm)",
)
def megamoe_selective_ac(cfg: SelectiveAC.Config) -> MegaMoESelectiveAC.Config:
    if type(cfg) is not SelectiveAC.Config:
        raise TypeError(
            f"megamoe_selective_ac replaces torchtitan's SelectiveAC.Config, got "
            f"{type(cfg).__qualname__} (its own save list would be dropped)"
        )
    return derive(cfg, MegaMoESelectiveAC.Config)
