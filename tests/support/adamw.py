"""The float64 AdamW that ``megamoe.optim.AdamW`` is checked against (CPU and GPU tests)."""

from __future__ import annotations

import math

import torch

# The tests' hyperparameters: a large lr and weight decay, so every term of the update counts.
LR, BETAS, EPS, WD = 3e-2, (0.9, 0.99), 1e-6, 0.1


def adamw64(p, g, m, v, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One AdamW step in float64 (torch's fused arithmetic, no roundings): the new (p, m, v),
    each with the magnitude its fp32 arithmetic rounds at (the sum of its terms' sizes)."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    m_new = BETAS[0] * m + (1 - BETAS[0]) * g
    m_size = BETAS[0] * m.abs() + (1 - BETAS[0]) * g.abs()  # (m_new may cancel)
    v_new = BETAS[1] * v + (1 - BETAS[1]) * g * g
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    step_size = (LR / bc1) / (v_new.sqrt() / math.sqrt(bc2) + EPS)
    p_new = p - LR * WD * p - step_size * m_new
    return [(p_new, p.abs() + step_size * m_size), (m_new, m_size), (v_new, v + g * g)]


def within_one_rounding(got: torch.Tensor, want: torch.Tensor, size: torch.Tensor) -> bool:
    """|got - want| within the stored dtype's rounding of ``want`` (half a unit, up to one
    with the fp32 error) plus a few fp32 roundings of the terms' ``size``."""
    err = (got.double() - want).abs()
    bound = torch.finfo(got.dtype).eps * want.abs() + 8 * torch.finfo(torch.float32).eps * size
    return bool((err <= bound).all())
