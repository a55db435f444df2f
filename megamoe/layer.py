"""``nn.Module`` front ends: the expert layer :class:`MoE` and the router :class:`TopKRouter`.

A full MoE block in three lines::

    router = TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k)
    moe = MoE(cfg, group=ep_group)
    y = moe(x, *router(x))
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from . import functional, ops
from .backends import BACKENDS, fp8_weights
from .config import MoEConfig
from .types import ExpertWeights
from .validation import group_size_rank

__all__ = ["MoE", "TopKRouter"]

SCORE_FUNCS = ("softmax", "sigmoid")


class MoE(nn.Module):
    """The routed experts this rank owns (and the shared expert), applied to routed tokens.

    Args:
        config: layer shape and kernel tunables.
        group: expert-parallel process group (None: one process owns every expert).
        backend: "auto" (best available for the input's device and the group's size:
            ``backends.auto_order``), "triton", "fused" or "reference".
        device, dtype: of the weights; the kernels want bfloat16.
        seed: global expert e is initialized from a generator seeded by (seed, e), and the
            shared expert from (seed, -1), so a seed builds the same model whatever the world size
            and every rank owns different experts. None draws the seed from torch's global RNG
            (the same on every rank when the ranks are seeded alike, as usual).
        check_values: run the input checks that read device values (ids in range, finite
            weights); they are skipped automatically while a CUDA graph is captured.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        seed: int | None = None,
        check_values: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(
                f"dtype must be a floating torch.dtype (bfloat16 for the kernels), got {dtype}"
            )
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {['auto', *BACKENDS]}, got {backend!r}")
        self.config = config
        # sharded by FSDP2 the weights are gathered anew for each forward: no fp8 copies kept
        self._gathered_config = dataclasses.replace(config, fp8_weight_cache=False)
        self.group = group
        self.backend = backend
        self.check_values = check_values
        self.world_size, self.rank = group_size_rank(group)
        self._group_name = ops.group_key(group)  # (the custom ops take the group by name)
        self.num_local_experts = config.local_experts(self.world_size)
        e, h, i = self.num_local_experts, config.hidden_size, config.intermediate_size
        kw = dict(device=device, dtype=dtype)
        self.w_gate = nn.Parameter(torch.empty(e, i, h, **kw))
        self.w_up = nn.Parameter(torch.empty(e, i, h, **kw))
        self.w_down = nn.Parameter(torch.empty(e, h, i, **kw))
        if config.has_shared_expert:
            i_s = config.shared_intermediate_size
            self.s_gate = nn.Parameter(torch.empty(i_s, h, **kw))
            self.s_up = nn.Parameter(torch.empty(i_s, h, **kw))
            self.s_down = nn.Parameter(torch.empty(h, i_s, **kw))
        else:
            self.register_parameter("s_gate", None)
            self.register_parameter("s_up", None)
            self.register_parameter("s_down", None)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """nn.Linear's default: uniform in +-1/sqrt(fan_in) for every projection."""
        if seed is None:
            # One draw, then per-expert streams: drawing every rank's local experts straight
            # from the global RNG would give the same experts on every identically seeded rank.
            seed = int(torch.randint(0, 2**62, ()).item())
        first = self.rank * self.num_local_experts
        for e in range(self.num_local_experts):
            gen = _generator(seed, first + e)
            for w in (self.w_gate[e], self.w_up[e], self.w_down[e]):
                _uniform_fan_in(w, gen)
        if self.s_gate is not None:
            gen = _generator(seed, -1)
            for w in (self.s_gate, self.s_up, self.s_down):
                _uniform_fan_in(w, gen)

    def weights(self) -> ExpertWeights:
        return ExpertWeights(
            self.w_gate, self.w_up, self.w_down, self.s_gate, self.s_up, self.s_down
        )

    def fp8_weight_views(self) -> list[torch.Tensor]:
        """The expert-weight views whose fp8 copies this layer keeps from call to call
        (``precision="fp8"`` with ``fp8_weight_cache``; none otherwise, nor while FSDP2 shards
        the layer): what ``megamoe.optim.AdamW(fp8_views=...)`` quantizes in its update."""
        c = self.config
        if c.precision != "fp8" or not c.fp8_weight_cache or self.backend == "reference":
            return []  # (backend "reference" quantizes in torch ops, without copies)
        if fp8_weights.gathered_per_call(self):
            return []
        return fp8_weights.views(self.weights())

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """``y[t] = shared(x[t]) + sum_k topk_weights[t,k] * expert_{topk_ids[t,k]}(x[t])``."""
        gathered = fp8_weights.gathered_per_call(self)
        return ops.moe(
            x,
            topk_ids,
            topk_weights,
            self.weights(),
            self._gathered_config if gathered else self.config,
            backend=self.backend,
            check_values=self.check_values,
            group_name=self._group_name,
        )

    def check(self) -> None:
        """Raise device-recorded errors of this layer's steps (bad expert ids, capacity
        overflow, stalled waits); see :func:`megamoe.functional.check`. Call it after CUDA-graph
        replays."""
        functional.check(self.group)

    def extra_repr(self) -> str:
        c = self.config
        shared = f"shared={c.shared_intermediate_size}" if c.has_shared_expert else "shared=none"
        return (
            f"hidden={c.hidden_size}, intermediate={c.intermediate_size}, "
            f"experts={c.num_experts} ({self.num_local_experts} local, rank {self.rank}/"
            f"{self.world_size}), top_k={c.top_k}, {shared}, backend={self.backend!r}"
        )


def _generator(seed: int, stream: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + stream + 1) % (2**63))
    return gen


def _uniform_fan_in(w: torch.Tensor, gen: torch.Generator) -> None:
    bound = 1.0 / math.sqrt(w.shape[-1])
    # Draw on the CPU so a seed gives the same weights on every device.
    vals = torch.empty(w.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
    w.copy_(vals)


class TopKRouter(nn.Module):
    """Linear gate + softmax (or sigmoid) scores, top-k experts per token.

    Returns ``(topk_ids int64 [T, K], topk_weights float32 [T, K])``; with ``renormalize`` the
    chosen weights sum to one per token.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        renormalize: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        # MoEConfig validates the counts (top_k <= num_experts, positive ints).
        MoEConfig(hidden_size, 1, num_experts, top_k)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize = score_func, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, score={self.score_func}, "
            f"renormalize={self.renormalize}"
        )
