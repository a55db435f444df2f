"""torchtitan 0.3.0 models for the megamoe override tests: the real config-registry entries
(``qwen3_moe_debug``, ``deepseek_v3_debugmodel``), an exact float32 twin of the native experts,
and the helpers that build a native and a megamoe module with the same weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torchtitan.config import derive
from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

OVERRIDES = "megamoe.integrations.torchtitan.overrides"
ROUTED = f"{OVERRIDES}.megamoe_routed_experts"
WHOLE_MOE = f"{OVERRIDES}.megamoe_moe"
SAC = f"{OVERRIDES}.megamoe_selective_ac"
# megamoe in float32 on the CPU (the tests' oracle runs the native experts in float32 too)
FP32 = {"backend": "reference", "compute_dtype": "float32"}

# name -> the registry function of a torchtitan 0.3.0 trainer config
REGISTRY: dict[str, Callable] = {
    "qwen3_moe_debug": qwen3_moe_debug,  # 64 experts, top-8, no shared expert
    "deepseek_v3_debugmodel": deepseek_v3_debugmodel,  # 8 experts, top-3, a shared expert
}


class Float32GroupedExperts(GroupedExperts):
    """The native experts in float32, one expert at a time (``GroupedExperts`` casts to
    bfloat16 before its grouped GEMMs): same parameters, same formula, float32 arithmetic."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        # unbind: one [E, ...] gradient per weight (indexing would add E full-size ones)
        w1, w3, w2 = (local(w).unbind(0) for w in (self.w1_EFD, self.w3_EFD, self.w2_EDF))
        out, start = [], 0
        for e, n in enumerate(counts_E.tolist()):
            xe = x_RD[start : start + n]
            start += n
            out.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        return torch.cat(out)


def trainer_config(name: str, layers: int | None = None, ep: int = 1, spmd_backend: str = ""):
    """The registry's trainer config with its model's sharding configs set (what the Trainer
    does before it applies overrides); ``layers`` keeps the first ones only."""
    cfg = REGISTRY[name]()
    if layers is not None:
        cfg.model_spec.model.layers = cfg.model_spec.model.layers[:layers]
    if ep > 1:
        cfg.parallelism.expert_parallel_degree = ep
        cfg.parallelism.data_parallel_shard_degree = ep
    if spmd_backend:
        cfg.parallelism.spmd_backend = spmd_backend
    cfg.model_spec.model.update_from_config(config=cfg)
    return cfg


def apply(cfg, entries: list) -> list[str]:
    """``apply_overrides`` with ``--override.imports``-style entries (strings are parsed as
    the CLI parses its tokens)."""
    imports = []
    for e in entries:
        imports.extend(parse_cli_imports([e]) if isinstance(e, str) else [e])
    return apply_overrides(OverrideConfig(imports=imports), cfg)


def float32_native(cfg) -> None:
    """Swap every native GroupedExperts config of ``cfg`` for its float32 twin."""
    for _, routed, _, _ in cfg.model_spec.model.traverse(RoutedExperts.Config):
        routed.inner_experts = derive(routed.inner_experts, Float32GroupedExperts.Config)


def moe_layers(model_config) -> list[tuple[int, MoE.Config]]:
    return [(i, layer.moe) for i, layer in enumerate(model_config.layers) if layer.moe is not None]


def moe_pair(name: str, override: str, options: dict | None = None, seed: int = 0, **cfg_kw):
    """(native float32 MoE, megamoe MoE) of the first MoE layer of ``name``, same weights."""
    native_cfg = trainer_config(name, **cfg_kw)
    float32_native(native_cfg)
    mega_cfg = trainer_config(name, **cfg_kw)
    apply(mega_cfg, [(override, dict(FP32 if options is None else options))])
    (i, native_moe), *_ = moe_layers(native_cfg.model_spec.model)
    torch.manual_seed(seed)
    native = native_moe.build()
    native.init_states()
    mega = mega_cfg.model_spec.model.layers[i].moe.build()
    mega.load_state_dict(native.state_dict(), strict=True)
    return native, mega


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
