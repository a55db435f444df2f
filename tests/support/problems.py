"""One case type and one problem builder for every test.

A :class:`Case` names a problem's shape (readable test ids); :func:`make_problem` draws it: the
global expert weights (the same on every rank), then per rank its routing, tokens and output
gradient, all bf16 (router weights fp32), random normal, never zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from megamoe.config import MoEConfig
from megamoe.tools.routing import make_routing
from megamoe.types import ExpertWeights

__all__ = [
    "Case",
    "params",
    "make_config",
    "Rank",
    "Problem",
    "make_problem",
    "routing_of",
    "random_weights",
    "slice_weights",
    "case_of",
    "PRESET_CASES",
]

ROUTINGS = ("uniform", "zipf", "one-rank", "one_expert", "empty_experts")


class Case(NamedTuple):
    """A problem's shape: tokens per rank, hidden, intermediate, global experts, top-k, the
    shared expert's intermediate size (0: none), routing, world size, GEMM block rows."""

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    shared: int = 0
    routing: str = "uniform"
    world: int = 1
    block_rows: int = 16

    @property
    def id(self) -> str:
        shared = f"-S{self.shared}" if self.shared else ""
        world = f"W{self.world}-" if self.world > 1 else ""
        return (
            f"{world}T{self.tokens}-H{self.hidden}-I{self.intermediate}-E{self.experts}"
            f"-K{self.top_k}{shared}-{self.routing}-B{self.block_rows}"
        )

    @property
    def local_experts(self) -> int:
        return self.experts // self.world

    def config(self, **tunables) -> MoEConfig:
        return make_config(
            self.hidden, self.intermediate, self.experts, self.top_k, self.shared, self.block_rows
        ).replace(**tunables)


# The presets' layer shapes as the GPU tests check them against the float64 oracle (one rank's
# experts), tokens sliced to keep the oracle quick; mok-v4 has 32 of its 48 experts: the
# oracle's float64 weights and their gradients (25 GB each with 48) did not fit an 80 GB H100.
PRESET_CASES = {
    "dsv3": Case(768, 7168, 2048, 32, 8, shared=2048, block_rows=128),
    "qwen3-30b": Case(1024, 2048, 768, 64, 8, block_rows=128),
    "mok-v4": Case(512, 7168, 3072, 32, 6, shared=3072, block_rows=128),
}


def params(*cases: Case) -> list:
    """``pytest.param`` of each case with its readable id."""
    return [pytest.param(c, id=c.id) for c in cases]


def make_config(h: int, i: int, e: int, k: int, i_s: int, block_rows: int) -> MoEConfig:
    """A test config: the fused kernel's minibatch and ring one block (tests raise them)."""
    return MoEConfig(
        hidden_size=h,
        intermediate_size=i,
        num_experts=e,
        top_k=k,
        shared_intermediate_size=i_s,
        block_rows=block_rows,
        minibatch_rows=block_rows,
        ring_rows=block_rows,
    )


def routing_of(
    kind: str, t: int, e: int, k: int, gen: torch.Generator, world: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [t, k], weights fp32 [t, k]): megamoe.tools.routing's kinds ("one-rank": every
    token to the last rank), "one_expert" (expert 0 gets every token) or "empty_experts" (only
    the first k+1 experts get rows)."""
    if kind in ("uniform", "zipf", "one-rank"):
        return make_routing(
            t, e, k, kind=kind, world_size=world, target_rank=world - 1, generator=gen
        )
    ids = torch.empty((t, k), dtype=torch.int64)
    if kind == "one_expert":
        ids[:, 0] = 0
        for j in range(1, k):
            ids[:, j] = 1 + (torch.arange(t) + j) % (e - 1) if e > 1 else 0
    elif kind == "empty_experts":
        ids = torch.stack([torch.randperm(k + 1, generator=gen)[:k] for _ in range(t)])
    else:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
    return ids, torch.softmax(torch.randn((t, k), generator=gen), dim=1)


def _rnd(
    gen: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def random_weights(
    cfg: MoEConfig, experts: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16
) -> ExpertWeights:
    """``experts`` experts (and the shared expert) of ``cfg``, normal / sqrt(fan_in)."""
    h, i, i_s = cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
    shared = (
        (
            _rnd(gen, i_s, h, scale=h**-0.5, dtype=dtype),
            _rnd(gen, i_s, h, scale=h**-0.5, dtype=dtype),
            _rnd(gen, h, i_s, scale=i_s**-0.5, dtype=dtype),
        )
        if i_s
        else (None, None, None)
    )
    return ExpertWeights(
        _rnd(gen, experts, i, h, scale=h**-0.5, dtype=dtype),
        _rnd(gen, experts, i, h, scale=h**-0.5, dtype=dtype),
        _rnd(gen, experts, h, i, scale=i**-0.5, dtype=dtype),
        *shared,
    )


def stacked_gate_up(weights: ExpertWeights) -> ExpertWeights:
    """The same weights with gate and up stacked in one [E, 2I, H] tensor (as the ops pass
    them): ``w_gate`` and ``w_up`` become its halves."""
    stacked = torch.cat([weights.w_gate, weights.w_up], dim=1)
    return ExpertWeights.from_gate_up(stacked, *weights[2:]).split_gate_up()


def slice_weights(weights: ExpertWeights, rank: int, world_size: int) -> ExpertWeights:
    """The experts rank ``rank`` of ``world_size`` owns: ``[rank*E/W, (rank+1)*E/W)``."""
    e_local = weights.w_gate.shape[0] // world_size
    sl = slice(rank * e_local, (rank + 1) * e_local)
    return ExpertWeights(
        weights.w_gate[sl],
        weights.w_up[sl],
        weights.w_down[sl],
        weights.s_gate,
        weights.s_up,
        weights.s_down,
    )


def case_of(config: MoEConfig, tokens: int, routing: str = "uniform", world: int = 1) -> Case:
    """The case of a layer config (its shape and block rows)."""
    return Case(
        tokens,
        config.hidden_size,
        config.intermediate_size,
        config.num_experts,
        config.top_k,
        config.shared_intermediate_size,
        routing,
        world,
        config.block_rows,
    )


class Rank(NamedTuple):
    """One rank's inputs: tokens, routing and the output gradient."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    grad_y: torch.Tensor


@dataclass
class Problem:
    """A drawn case: its config, the global weights and each rank's inputs."""

    case: Case
    config: MoEConfig
    weights: ExpertWeights
    ranks: list[Rank]

    def local_weights(self, rank: int) -> ExpertWeights:
        """The experts ``rank`` owns (and the shared expert)."""
        return slice_weights(self.weights, rank, self.case.world)

    @property
    def single(self) -> Rank:
        """Every rank's inputs concatenated: the same global batch in one process."""
        return Rank(*(torch.cat([r[j] for r in self.ranks]) for j in range(4)))

    # one-rank shorthands
    @property
    def x(self) -> torch.Tensor:
        return self.single.x

    @property
    def topk_ids(self) -> torch.Tensor:
        return self.single.topk_ids

    @property
    def topk_weights(self) -> torch.Tensor:
        return self.single.topk_weights

    @property
    def grad_y(self) -> torch.Tensor:
        return self.single.grad_y


def make_problem(
    case: Case,
    seed: int,
    device: torch.device | str = "cpu",
    ids_dtype: torch.dtype = torch.int64,
    dtype: torch.dtype = torch.bfloat16,
    **tunables,
) -> Problem:
    """Draw ``case`` from ``seed`` (weights first, then per rank: routing, x, dy) in ``dtype``
    (router weights fp32)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = case.config(**tunables)
    weights = random_weights(cfg, case.experts, gen, dtype)
    ranks = []
    for _ in range(case.world):
        ids, w = routing_of(case.routing, case.tokens, case.experts, case.top_k, gen, case.world)
        x = _rnd(gen, case.tokens, case.hidden, dtype=dtype)
        dy = _rnd(gen, case.tokens, case.hidden, dtype=dtype)
        ranks.append(
            Rank(x.to(device), ids.to(device=device, dtype=ids_dtype), w.to(device), dy.to(device))
        )
    weights = ExpertWeights(*(None if t is None else t.to(device) for t in weights))
    return Problem(case, cfg, weights, ranks)
