"""Synthetic routing for benchmarks and tests.

A real router's output depends on a trained gate; benchmarks need routings whose load pattern is
known in advance instead: balanced (``uniform``), skewed towards a few experts (``zipf``), and the
worst case for expert parallelism where every token goes to the experts of one rank
(``one-rank``). All kinds pick ``top_k`` *distinct* experts per token by Gumbel-top-k sampling
(sampling without replacement from the kind's expert distribution) and give them softmax weights
over random logits, like a softmax router would. Everything is drawn from ``generator`` on the
CPU, so a seed gives the same routing on every device.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ROUTING_KINDS", "make_routing", "expert_log_probs"]

ROUTING_KINDS: tuple[str, ...] = ("uniform", "zipf", "one-rank")

# Smallest float that keeps log(uniform) finite in the Gumbel draw.
_GUMBEL_EPS = 1e-20


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def expert_log_probs(
    num_experts: int,
    *,
    kind: str = "uniform",
    world_size: int = 1,
    target_rank: int = 0,
    zipf_alpha: float = 1.2,
) -> torch.Tensor:
    """Log of the (unnormalized) probability of each expert under ``kind``; -inf = never chosen.

    zipf: expert ``e`` has weight ``1 / (e + 1) ** zipf_alpha``, so the low experts (and thus the
    low ranks under expert parallelism) are the hot ones: a predictable skew.
    """
    if kind == "uniform":
        return torch.zeros(num_experts, dtype=torch.float64)
    if kind == "zipf":
        if not (
            isinstance(zipf_alpha, (int, float)) and math.isfinite(zipf_alpha) and zipf_alpha > 0
        ):
            raise ValueError(f"zipf_alpha must be a finite number > 0, got {zipf_alpha!r}")
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
        return -zipf_alpha * torch.log(ranks)
    if kind == "one-rank":
        if num_experts % world_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by world_size, got {world_size}"
            )
        if not 0 <= target_rank < world_size:
            raise ValueError(
                f"target_rank must be in [0, world_size={world_size}), got {target_rank}"
            )
        local = num_experts // world_size
        logp = torch.full((num_experts,), -math.inf, dtype=torch.float64)
        logp[target_rank * local : (target_rank + 1) * local] = 0.0
        return logp
    raise ValueError(f"kind must be one of {list(ROUTING_KINDS)}, got {kind!r}")


def make_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    kind: str = "uniform",
    world_size: int = 1,
    target_rank: int = 0,
    zipf_alpha: float = 1.2,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(topk_ids int64 [T, K], topk_weights float32 [T, K])`` for ``num_tokens`` tokens.

    ``num_experts`` is the global expert count. ``one-rank`` routes every token to the experts of
    ``target_rank`` (rank r owns experts ``[r*E/W, (r+1)*E/W)``) and so needs ``E/W >= top_k``.
    Deterministic for a given ``generator`` state (drawn on the CPU, then moved to ``device``).
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("num_experts", num_experts, 1)
    _check_int("top_k", top_k, 1)
    _check_int("world_size", world_size, 1)
    _check_int("target_rank", target_rank, 0)
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= num_experts ({num_experts}), got {top_k}")
    if kind == "one-rank" and num_experts % world_size == 0 and num_experts // world_size < top_k:
        raise ValueError(
            f"kind='one-rank' needs at least top_k={top_k} experts per rank, got "
            f"num_experts/world_size = {num_experts}/{world_size} = {num_experts // world_size}"
        )
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU generator, got one on {generator.device}")
    logp = expert_log_probs(
        num_experts,
        kind=kind,
        world_size=world_size,
        target_rank=target_rank,
        zipf_alpha=zipf_alpha,
    )

    # Gumbel-top-k: the top_k of log p + Gumbel noise are a sample without replacement from p.
    u = torch.rand((num_tokens, num_experts), generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(_GUMBEL_EPS)))
    topk_ids = torch.topk(logp + gumbel, top_k, dim=1).indices

    logits = torch.randn((num_tokens, top_k), generator=generator, dtype=torch.float32)
    topk_weights = torch.softmax(logits, dim=1)
    return topk_ids.to(device=device), topk_weights.to(device=device)
