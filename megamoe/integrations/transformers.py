"""megamoe as an experts implementation of Hugging Face transformers 5.x (extra ``megamoe[hf]``).

Importing this module registers megamoe in transformers' registries:

- ``ExpertsInterface`` (one process, or experts that are not split between ranks): the keys
  ``"megamoe"`` (backend ``"auto"``), ``"megamoe_triton"``, ``"megamoe_fused"`` and
  ``"megamoe_reference"`` (one pinned backend each, so runs can compare them), and their fp8
  twins ``"megamoe_fp8"``, ``"megamoe_triton_fp8"``, ``"megamoe_fused_fp8"`` and
  ``"megamoe_reference_fp8"`` (``MoEConfig(precision="fp8")``: DeepSeek-V3's block-scaled E4M3
  recipe, docs/fp8.md). Select one with ``from_pretrained(..., experts_implementation=key)`` or
  ``model.set_experts_implementation(key)``; :func:`experts_implementation` gives the key of a
  backend and precision.
- ``EPImplementationInterface`` (expert parallelism over W > 1 ranks): the key ``"megamoe"``, for
  ``DistributedConfig(ep_size=W, fsdp_size=W, ep_implementation="megamoe")``. megamoe then does
  the token dispatch and combine itself; the backend and precision are the ones the model's
  experts implementation names when that is a megamoe key, else ``"auto"`` in bf16.

Versions (transformers >= 5.17, < 6):

- 5.17 and later: the experts keys, with ``from_pretrained(experts_implementation=...)`` and
  ``set_experts_implementation``.
- 5.23 and later: expert parallelism (``ep_implementation="megamoe"``); transformers 5.17 to 5.22
  have no ``EPImplementationInterface``, so there megamoe runs with its experts unsplit only
  (:data:`SUPPORTS_EXPERT_PARALLEL` says which applies).

The weights are used where they are, with no copy or re-layout per step: ``gate_up_proj
[E, 2I, H]`` (the I gate rows of each expert, then its I up rows) goes into the op as itself
(:meth:`megamoe.ExpertWeights.from_gate_up`), so its gradient arrives as one ``[E, 2I, H]``
tensor, and ``down_proj [E, H, I]`` as it is. Experts modules that store another layout, have
biases, a post-expert norm, an activation other than SiLU, or their own gate function (gpt-oss's
clamped SwiGLU, for example) are refused with an error naming the module and the attribute.

Not to be confused with transformers' own ``"deepgemm_megamoe"`` (DeepGEMM's FP8 x FP4 "Mega
MoE" inference kernel): a different project; these keys never match it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import functional
from ..backends import BACKEND_PRECISIONS, fp8_weights
from ..backends.fp8_weights import gathered_per_call
from ..config import PRECISIONS, MoEConfig
from ..types import ExpertWeights

try:
    import transformers
    import transformers.activations
    from transformers.integrations import moe as _hf_moe
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "megamoe.integrations.transformers needs transformers>=5.17,<6 (pip install 'megamoe[hf]')"
    ) from exc

__all__ = [
    "BACKENDS",
    "EP_IMPLEMENTATION",
    "SUPPORTS_EXPERT_PARALLEL",
    "experts_implementation",
    "experts_forward",
    "fp8_weight_views",
    "register",
    "set_check_values",
]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


_TRANSFORMERS_VERSION = _version(transformers.__version__)
if not (5, 17) <= _TRANSFORMERS_VERSION < (6, 0):
    raise ImportError(
        f"megamoe.integrations.transformers needs transformers>=5.17,<6, got "
        f"{transformers.__version__}"
    )

try:  # transformers >= 5.23
    from transformers.distributed.expert_parallel import (
        EPImplementation as _EPImplementation,
    )
    from transformers.distributed.expert_parallel import (
        EPImplementationInterface as _EPImplementationInterface,
    )
except ImportError:
    _EPImplementation = None
    _EPImplementationInterface = None

# The megamoe backends an experts key can pin, and the key of each (backend, precision): bf16
# "megamoe" / "megamoe_<backend>", fp8 the same with "_fp8" (the backends that run fp8).
BACKENDS: tuple[str, ...] = ("auto", "triton", "fused", "reference")
_KEYS: dict[tuple[str, str], str] = {
    (b, p): ("megamoe" if b == "auto" else f"megamoe_{b}") + ("" if p == "bf16" else f"_{p}")
    for p in PRECISIONS
    for b in BACKENDS
    if b == "auto" or p in BACKEND_PRECISIONS[b]
}
_RUN_OF_KEY: dict[str, tuple[str, str]] = {key: run for run, key in _KEYS.items()}

# The ``ep_implementation`` key of expert parallelism through megamoe (transformers >= 5.23).
EP_IMPLEMENTATION = "megamoe"
SUPPORTS_EXPERT_PARALLEL: bool = _EPImplementationInterface is not None

_check_values = True
_CONFIGS: dict[tuple[int, int, int, int, str], MoEConfig] = {}


def experts_implementation(backend: str = "auto", precision: str = "bf16") -> str:
    """The ``experts_implementation`` key that runs megamoe with ``backend`` ("auto", "triton",
    "fused" or "reference") in ``precision`` ("bf16" or "fp8"; ``MoEConfig.precision``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    key = _KEYS.get((backend, precision))
    if key is None:
        runs = [b for b in BACKENDS if (b, precision) in _KEYS]
        raise ValueError(
            f"backend {backend!r} does not run precision {precision!r}; the backends that do: "
            f"{runs}"
        )
    return key


def set_check_values(enabled: bool) -> None:
    """Whether megamoe's input checks that read device values (ids in range and distinct,
    finite weights, equal token counts across ranks) run in every call; on by default. They
    synchronize with the host; the Triton backends also check on the device, so a GPU run that
    wants no host sync per layer can turn them off (megamoe.functional.moe, ``check_values``)."""
    global _check_values
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    _check_values = enabled


def _config(
    hidden: int, intermediate: int, num_experts: int, top_k: int, precision: str, gathered: bool
) -> MoEConfig:
    """The MoEConfig of one layer shape and precision, built once; ``gathered``: FSDP gathers
    the weights for each call, so their fp8 copies are not cached (``fp8_weight_cache``)."""
    key = (hidden, intermediate, num_experts, top_k, precision, gathered)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = MoEConfig(
            hidden,
            intermediate,
            num_experts,
            top_k,
            precision=precision,
            fp8_weight_cache=not gathered,
        )
        _CONFIGS[key] = cfg
    return cfg


def _is_silu(act: object) -> bool:
    if isinstance(act, torch.nn.SiLU):
        return True
    silu = getattr(transformers.activations, "SiLUActivation", None)
    return silu is not None and type(act) is silu


def _check_layout(module: torch.nn.Module) -> None:
    """Refuse an experts module whose weights or math megamoe cannot take as they are."""
    name = type(module).__name__
    expected = {
        "has_gate": True,  # gate_up_proj, not an up_proj alone
        "is_concatenated": True,  # [gate rows; up rows], not interleaved
        "is_transposed": False,  # [E, 2I, H] (nn.Linear), not [E, H, 2I]
        "has_bias": False,
        "has_post_expert_norm": False,
    }
    for flag, want in expected.items():
        got = getattr(module, flag, False if flag == "has_post_expert_norm" else None)
        if got is None:
            raise ValueError(
                f"{name} has no attribute {flag!r}: megamoe runs experts modules decorated with "
                "transformers' @use_experts_implementation"
            )
        if bool(got) != want:
            raise ValueError(_LAYOUT_ERRORS[flag].format(name=name, got=got, want=want))
    gate_fn = getattr(type(module), "_apply_gate", None)
    default_gate = getattr(_hf_moe, "_default_apply_gate", None)
    if gate_fn is not None and gate_fn is not default_gate:
        raise ValueError(
            f"{name} defines its own _apply_gate ({gate_fn.__qualname__}): megamoe computes "
            "silu(gate) * up only, not a custom gate (e.g. gpt-oss's clamped SwiGLU)"
        )
    act = getattr(module, "act_fn", None)
    if not _is_silu(act):
        raise ValueError(
            f"{name}.act_fn must be SiLU (hidden_act 'silu'), got {type(act).__name__}: megamoe "
            "computes silu(gate) * up"
        )


_LAYOUT_ERRORS = {
    "has_gate": (
        "{name}.has_gate is {got}, expected {want}: megamoe runs gated experts "
        "(gate_up_proj), not an up projection alone"
    ),
    "is_concatenated": (
        "{name}.is_concatenated is {got}, expected {want}: megamoe reads gate_up_proj as the "
        "I gate rows of each expert followed by its I up rows; interleaved gate/up rows would "
        "need a copy every step"
    ),
    "is_transposed": (
        "{name}.is_transposed is {got}, expected {want}: megamoe takes gate_up_proj "
        "[E, 2I, H] and down_proj [E, H, I] (nn.Linear layout); transposed weights would need "
        "a copy every step"
    ),
    "has_bias": ("{name}.has_bias is {got}, expected {want}: megamoe's experts have no biases"),
    "has_post_expert_norm": (
        "{name}.has_post_expert_norm is {got}, expected {want}: megamoe has no norm after "
        "the experts"
    ),
}


def _weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """The module's ``gate_up_proj`` and ``down_proj`` (checked), and (E_local, I, H)."""
    name = type(module).__name__
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(
            f"{name}.gate_up_proj must be [num_experts, 2 * intermediate, hidden], got "
            f"{list(gate_up.shape)}"
        )
    e, i, h = gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
    if tuple(down.shape) != (e, h, i):
        raise ValueError(
            f"{name}.down_proj must be [{e}, {h}, {i}] (num_experts, hidden, intermediate) to "
            f"match gate_up_proj {list(gate_up.shape)}, got {list(down.shape)}"
        )
    return gate_up, down, e, i, h


def _run(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: str,
    precision: str,
    group: dist.ProcessGroup | None,
    world_size: int,
) -> torch.Tensor:
    _check_layout(module)
    gate_up, down, e_local, i, h = _weights(module)
    if hidden_states.dim() != 2 or top_k_index.dim() != 2:
        raise ValueError(
            f"{type(module).__name__}: megamoe takes hidden_states [tokens, hidden] and "
            f"top_k_index [tokens, top_k], got {list(hidden_states.shape)} and "
            f"{list(top_k_index.shape)}"
        )
    x = hidden_states
    if x.dtype != down.dtype:  # as transformers' grouped_mm: the inputs in the weights' dtype
        x = x.to(down.dtype)
    k = top_k_index.shape[1]
    cfg = _config(h, i, e_local * world_size, k, precision, gathered_per_call(module))
    # gate_up_proj itself is the op's input (no copy), so its gradient lands on it as one tensor
    y = functional.moe(
        x.contiguous(),
        top_k_index.long().contiguous(),
        top_k_weights.float().contiguous(),
        ExpertWeights.from_gate_up(gate_up, down),
        cfg,
        group=group,
        backend=backend,
        check_values=_check_values,
    )
    return y.to(hidden_states.dtype)


def fp8_weight_views(module: torch.nn.Module) -> list[torch.Tensor]:
    """The expert-weight views whose fp8 copies megamoe keeps for ``module``, a transformers
    experts module running a megamoe fp8 key (not FSDP2-sharded); none for any other module:
    what ``megamoe.optim.AdamW(fp8_views=...)`` quantizes (``megamoe.optim.fp8_weight_views``)."""
    key = getattr(getattr(module, "config", None), "_experts_implementation", None)
    run = _RUN_OF_KEY.get(key) if isinstance(key, str) else None
    if run is None or run[1] != "fp8" or run[0] == "reference" or gathered_per_call(module):
        return []
    if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
        return []
    gate_up, down, *_ = _weights(module)
    return fp8_weights.views(ExpertWeights.from_gate_up(gate_up, down))


def _split(module: torch.nn.Module) -> str | None:
    """How transformers splits this experts module between ranks, or None when it does not."""
    if getattr(module, "_is_expert_parallel", False):
        return "its experts are sharded between expert-parallel ranks"
    dc = getattr(getattr(module, "config", None), "distributed_config", None)
    if dc is None:
        return None
    if getattr(dc, "enable_expert_parallel", False):
        return "DistributedConfig(enable_expert_parallel=True)"
    for size in ("ep_size", "tp_size"):
        value = getattr(dc, size, None)
        if value is not None and value > 1:
            return f"DistributedConfig({size}={value})"
    return None


def _refuse_split(module: torch.nn.Module, backend: str, precision: str) -> None:
    how = _split(module)
    if how is None:
        return
    ep = (
        f"DistributedConfig(ep_size=W, fsdp_size=W, ep_implementation={EP_IMPLEMENTATION!r}), "
        "where megamoe exchanges the tokens itself"
        if SUPPORTS_EXPERT_PARALLEL
        else "transformers >= 5.23 with DistributedConfig(ep_implementation="
        f"{EP_IMPLEMENTATION!r}) (this is {transformers.__version__})"
    )
    raise ValueError(
        f"{type(module).__name__} is split between ranks ({how}), but "
        f"experts_implementation={experts_implementation(backend, precision)!r} runs whole "
        "experts in "
        f"each process (FSDP alone is fine); for expert parallelism use {ep}"
    )


def experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: str = "auto",
    precision: str = "bf16",
) -> torch.Tensor:
    """The forward of an experts module through megamoe, on this process's experts: ``y [T, H]
    = sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden_states[t])`` (what the
    registered keys run)."""
    experts_implementation(backend, precision)  # a bad pair is refused by name
    _refuse_split(module, backend, precision)
    return _run(
        module,
        hidden_states,
        top_k_index,
        top_k_weights,
        backend=backend,
        precision=precision,
        group=None,
        world_size=1,
    )


def _registered_forward(backend: str, precision: str):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return experts_forward(
            self, hidden_states, top_k_index, top_k_weights, backend=backend, precision=precision
        )

    name = experts_implementation(backend, precision)
    forward.__name__ = forward.__qualname__ = f"{name}_experts_forward"
    return forward


if _EPImplementation is not None:

    class MegaMoEExpertParallel(_EPImplementation):
        """``ep_implementation="megamoe"``: each rank hands megamoe its own tokens with global
        expert ids and its local experts; megamoe dispatches them to the experts' ranks and
        combines the weighted outputs back (gradients included). Every rank of the EP group must
        hold its own batch (no tensor parallelism) with the same number of tokens."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            name = type(experts).__name__
            if tp_mesh.size() != 1:
                raise ValueError(
                    f'ep_implementation="megamoe" ({name}) needs tp_size 1 (every rank its own '
                    f"tokens), got a tensor-parallel group of {tp_mesh.size()} ranks"
                )
            _check_layout(experts)
            self.experts = experts
            self.group = ep_mesh.get_group()
            self.world_size = ep_mesh.size()
            rank = dist.get_rank(self.group)
            if rank != ep_mesh.get_local_rank():
                raise ValueError(
                    f"{name}: rank {rank} of the expert-parallel group holds the experts of mesh "
                    f"position {ep_mesh.get_local_rank()}; megamoe needs them to agree"
                )

        def _run_kind(self) -> tuple[str, str]:
            """(backend, precision) of the model's experts key, ("auto", "bf16") when it is not
            a megamoe key."""
            key = getattr(getattr(self.experts, "config", None), "_experts_implementation", None)
            return _RUN_OF_KEY.get(key, ("auto", "bf16"))

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            from torch.distributed.tensor import DTensor

            hidden_states, top_k_index, top_k_weights = (
                t.to_local() if isinstance(t, DTensor) else t
                for t in (hidden_states, top_k_index, top_k_weights)
            )
            backend, precision = self._run_kind()
            return _run(
                self.experts,
                hidden_states,
                top_k_index,
                top_k_weights,
                backend=backend,
                precision=precision,
                group=self.group,
                world_size=self.world_size,
            )

    __all__.append("MegaMoEExpertParallel")


def register() -> None:
    """Register the keys (done on import; again is harmless)."""
    for (backend, precision), key in _KEYS.items():
        _hf_moe.ExpertsInterface.register(key, _registered_forward(backend, precision))
    if _EPImplementationInterface is not None:
        _EPImplementationInterface.register(EP_IMPLEMENTATION, MegaMoEExpertParallel)


register()
