"""Input checks shared by every backend: each error names the argument, the value and what was
expected.

Shape/dtype/device checks are free (no device work). Value checks (ids in range, no duplicate
ids per token, finite router weights, equal token counts across ranks) read device values and
therefore synchronize with the host; they run unless ``check_values=False`` or a CUDA graph is
being captured, where a host read is impossible.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import MoEConfig
from .types import ExpertWeights

__all__ = ["validate_inputs", "validate_weights", "group_size_rank", "value_checks_enabled"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ID_DTYPES = (torch.int32, torch.int64)


def group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(world size, rank) of the expert-parallel group; (1, 0) for a single process."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def value_checks_enabled(check_values: bool) -> bool:
    if not check_values:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_tensor(
    name: str,
    t: object,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(_name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {_name(t.dtype)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on device {device} (where x is), got {t.device}")


def require_expert_weights(weights: object) -> None:
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be a megamoe.ExpertWeights, got {type(weights).__name__}")


def validate_weights(
    weights: ExpertWeights,
    config: MoEConfig,
    world_size: int,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Check expert (and shared expert) weight shapes against the config and world size."""
    e_local = config.local_experts(world_size)
    h, i, i_s = config.hidden_size, config.intermediate_size, config.shared_intermediate_size
    _check_tensor("w_gate", weights.w_gate, (e_local, i, h), FLOAT_DTYPES, device)
    if dtype is not None and weights.w_gate.dtype != dtype:
        raise TypeError(
            f"x must have the dtype of the layer's weights ({_name(weights.w_gate.dtype)}), got "
            f"{_name(dtype)}"
        )
    dtypes = (weights.w_gate.dtype,)
    _check_tensor("w_up", weights.w_up, (e_local, i, h), dtypes, device)
    _check_tensor("w_down", weights.w_down, (e_local, h, i), dtypes, device)
    shared = (weights.s_gate, weights.s_up, weights.s_down)
    if config.has_shared_expert:
        if any(s is None for s in shared):
            raise ValueError(
                f"config has shared_intermediate_size={i_s}, so s_gate, s_up and s_down are "
                f"required"
            )
        _check_tensor("s_gate", weights.s_gate, (i_s, h), dtypes, device)
        _check_tensor("s_up", weights.s_up, (i_s, h), dtypes, device)
        _check_tensor("s_down", weights.s_down, (h, i_s), dtypes, device)
    elif any(s is not None for s in shared):
        raise ValueError("shared expert weights given but config.shared_intermediate_size is 0")


def validate_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None = None,
    *,
    check_values: bool = True,
) -> None:
    """Check one MoE call's inputs; raise TypeError/ValueError naming what is wrong."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != config.hidden_size:
        raise ValueError(f"x must have shape [tokens, {config.hidden_size}], got {list(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be a floating tensor (bfloat16 for the kernels), got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(
            f"x must be contiguous, got strides {x.stride()} for shape {list(x.shape)}"
        )
    t, k = x.shape[0], config.top_k
    world_size, _ = group_size_rank(group)
    _check_tensor("topk_ids", topk_ids, (t, k), ID_DTYPES, x.device)
    _check_tensor("topk_weights", topk_weights, (t, k), (torch.float32,), x.device)
    validate_weights(weights, config, world_size, x.device, x.dtype)
    if group is not None and dist.get_backend(group) == "nccl" and x.device.type != "cuda":
        raise ValueError(f"x must be on a CUDA device for an NCCL group, got {x.device}")
    if value_checks_enabled(check_values):
        _validate_values(topk_ids, topk_weights, config, group)


def _validate_values(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
) -> None:
    e = config.num_experts
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= e:
            bad = lo if lo < 0 else hi
            tok = int(((topk_ids < 0) | (topk_ids >= e)).any(dim=1).nonzero()[0])
            raise ValueError(f"topk_ids must be in [0, {e}), got {bad} (token {tok})")
        if config.top_k > 1:
            s = topk_ids.sort(dim=1).values
            dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
            if bool(dup.any()):
                tok = int(dup.nonzero()[0])
                raise ValueError(
                    f"topk_ids must hold distinct experts per token, got {topk_ids[tok].tolist()} "
                    f"for token {tok}"
                )
        finite = torch.isfinite(topk_weights).all(dim=1)
        if not bool(finite.all()):
            tok = int((~finite).nonzero()[0])
            raise ValueError(
                f"topk_weights must be finite, got {topk_weights[tok].tolist()} for token {tok}"
            )
    if group is not None:
        world_size, rank = group_size_rank(group)
        counts = torch.zeros(world_size, dtype=torch.int64, device=topk_ids.device)
        counts[rank] = topk_ids.shape[0]
        dist.all_reduce(counts, group=group)
        if bool((counts != counts[0]).any()):
            raise ValueError(
                "x must have the same number of tokens on every rank of the expert-parallel group, "
                f"got {counts.tolist()} (rank {rank} has {topk_ids.shape[0]})"
            )
