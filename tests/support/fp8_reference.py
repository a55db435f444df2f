"""Torch references of the fp8 quantizers (docs/fp8.md, "The recipe"): the scales from float64
log2, the casts by torch's ``.to(torch.float8_e4m3fn)``. The CPU tests hold the interpreter's
kernels to them and the GPU tests the compiled ones."""

from __future__ import annotations

import torch
import triton

FP8 = torch.float8_e4m3fn


def ref_scale(amax: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax / 448)) in float64, exponent >= -126; 1 for 0; inf for inf."""
    a = amax.double()
    n = torch.ceil(torch.log2(a / 448.0)).clamp(min=-126)
    n = torch.where(a == 0, torch.zeros_like(n), n)
    return torch.exp2(n).float()


def ref_quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., B, 128] blocks -> (q, scale [..., B]) with the NaN-ignoring amax of each block."""
    x = x.float()
    amax = torch.where(x.isnan(), 0.0, x.abs()).amax(dim=-1)
    scale = ref_scale(amax)
    return (x / scale[..., None]).to(FP8), scale


def ref_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    kb = triton.cdiv(k, 128)
    padded = torch.zeros(m, kb * 128, dtype=torch.float32)
    padded[:, :k] = x.float()
    q, scale = ref_quantize_blocks(padded.view(m, kb, 128))
    return q.view(m, kb * 128)[:, :k], scale


def ref_quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
    nb, kb = triton.cdiv(n, 128), triton.cdiv(k, 128)
    padded = torch.zeros(e, nb * 128, kb * 128, dtype=torch.float32)
    padded[:, :n, :k] = w.float()
    blocks = padded.view(e, nb, 128, kb, 128).permute(0, 1, 3, 2, 4).reshape(e, nb, kb, -1)
    q, scale = ref_quantize_blocks(blocks)
    q = q.view(e, nb, kb, 128, 128).permute(0, 1, 3, 2, 4).reshape(e, nb * 128, kb * 128)
    return q[:, :n, :k], scale


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
