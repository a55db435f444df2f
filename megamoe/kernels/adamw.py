"""AdamW's update in Triton, with an fp8 layer's weight copies written by the same pass.

An fp8 layer reads 128x128-block E4M3 copies of its expert weights (``fp8.quantize_weight``,
both layouts), and they change at every optimizer step. A quantization pass of their own reads
each weight and writes both copies: 4 bytes an element of a bf16 weight. The update already
holds each weight's new value in registers, so writing the copies there adds only their 2
bytes (docs/fp8.md, "The optimizer writes the fp8 copies").

The arithmetic is that of torch's fused AdamW (``torch.optim.AdamW(fused=True)``), in fp32, with
one rounding per stored tensor::

    p <- p - lr * wd * p
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g * g
    p <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)     bc_i = 1 - beta_i ** step

(square root and division correctly rounded; the step's scalars computed on the host in float64
and passed as fp32). The copies are quantized from the stored weight (its dtype's rounding), so
they are ``quantize_weight`` of the new weight bit for bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp8 import (
    BLOCK,
    FP8,
    Fp8Weight,
    block_amax,
    pow2_scale,
    source_f32,
    store_weight_rows,
    store_weight_scale,
)
from .runtime import cdiv, empty, interpreting, launch

__all__ = ["AdamWStep", "adamw_update", "adamw_", "adamw_quantize_"]

# Elements of one program of the elementwise update.
_BLOCK = 2048
# A 128x128 block's program: rows updated at a time, warps, whether the new block is read back
_BLOCK_ROWS = 32
_BLOCK_WARPS = 16
_BLOCK_REREAD = False


class AdamWStep(NamedTuple):
    """One parameter group's hyperparameters at one step (``step`` counts from 1)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    def scalars(self) -> tuple[float, float, float, float, float, float]:
        """(lr * wd, beta1, beta2, lr / bc1, sqrt(bc2), eps), as the kernels take them."""
        bc1 = 1.0 - self.beta1**self.step
        bc2 = 1.0 - self.beta2**self.step
        return (
            self.lr * self.weight_decay,
            self.beta1,
            self.beta2,
            self.lr / bc1,
            math.sqrt(bc2),
            self.eps,
        )


@triton.jit
def adamw_update(p, g, m, v, lr_wd, beta1, beta2, step_size, bc2_sqrt, eps):
    """AdamW on fp32 tiles: the new (p, m, v)."""
    p = p - lr_wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    return p, m, v


@triton.jit
def _load_f32(ptr, offsets, mask, UPCAST: tl.constexpr):
    return source_f32(tl.load(ptr + offsets, mask=mask, other=0.0), UPCAST)


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, numel, lr_wd, beta1, beta2, step_size, bc2_sqrt,
                  eps, BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """``BLOCK_SIZE`` elements of contiguous p, g, m, v, updated in place."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < numel
    p, m, v = adamw_update(
        _load_f32(p_ptr, offsets, mask, UPCAST), _load_f32(g_ptr, offsets, mask, UPCAST),
        _load_f32(m_ptr, offsets, mask, UPCAST), _load_f32(v_ptr, offsets, mask, UPCAST),
        lr_wd, beta1, beta2, step_size, bc2_sqrt, eps,
    )  # fmt: skip
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _view_tile(rows, cols, N, K, stride_n, stride_k):
    """(offsets, mask) of rows ``rows`` x columns ``cols`` of one expert's [N, K] view."""
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    return rows[:, None] * stride_n + cols[None, :] * stride_k, mask


@triton.jit
def _update_rows(p_ptr, g_ptr, m_ptr, v_ptr, rows, cols, N, K, stride_n, stride_k,
                 lr_wd, beta1, beta2, step_size, bc2_sqrt, eps, UPCAST: tl.constexpr):  # fmt: skip
    """Rows ``rows`` x columns ``cols`` of one expert's [N, K] view (the pointers at its
    start) updated in place: the new p as stored (zero past N or K) and its absolute
    maximum."""
    offsets, mask = _view_tile(rows, cols, N, K, stride_n, stride_k)
    p, m, v = adamw_update(
        _load_f32(p_ptr, offsets, mask, UPCAST), _load_f32(g_ptr, offsets, mask, UPCAST),
        _load_f32(m_ptr, offsets, mask, UPCAST), _load_f32(v_ptr, offsets, mask, UPCAST),
        lr_wd, beta1, beta2, step_size, bc2_sqrt, eps,
    )  # fmt: skip
    stored = tl.where(mask, p.to(p_ptr.dtype.element_ty), 0.0)
    tl.store(p_ptr + offsets, stored, mask=mask)
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
    return stored, tl.max(block_amax(source_f32(stored, UPCAST), 1), axis=0)


@triton.jit
def _adamw_fp8_kernel(p_ptr, g_ptr, m_ptr, v_ptr, N, K, stride_e, stride_n, stride_k,
                      lr_wd, beta1, beta2, step_size, bc2_sqrt, eps,
                      q_ptr, s_ptr, qt_ptr, st_ptr,
                      ROWS: tl.constexpr, REREAD: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """One 128x128 block (expert e, row block nb, column block kb) of [E, N, K] views p, g, m,
    v of one layout (strides), updated in place ``ROWS`` rows at a time (the four tensors of
    a whole block spill), and the new block quantized both ways by the amax of all its parts.
    The new block's parts are kept in registers as stored, or (``REREAD``) read back after a
    barrier: this program's own stores, still in L2, so that several blocks' programs fit an
    SM."""
    e = tl.program_id(0)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    at = e.to(tl.int64) * stride_e
    p_ptr, g_ptr, m_ptr, v_ptr = p_ptr + at, g_ptr + at, m_ptr + at, v_ptr + at
    cols = kb * 128 + tl.arange(0, 128)
    hyper = lr_wd, beta1, beta2, step_size, bc2_sqrt, eps
    fp32 = p_ptr.dtype.element_ty == tl.float32
    amax = 0.0
    if REREAD:
        for part in range(128 // ROWS):  # (a loop: unrolled, its loads would all be in flight)
            rows = nb * 128 + part * ROWS + tl.arange(0, ROWS)
            _, part_max = _update_rows(p_ptr, g_ptr, m_ptr, v_ptr, rows, cols, N, K, stride_n,
                                       stride_k, *hyper, UPCAST)  # fmt: skip
            amax = tl.maximum(amax, part_max)
        scale, inverse = pow2_scale(amax)
        tl.debug_barrier()  # every thread's stores of p visible to the block's loads
        for part in range(128 // ROWS):
            rows = nb * 128 + part * ROWS + tl.arange(0, ROWS)
            offsets, mask = _view_tile(rows, cols, N, K, stride_n, stride_k)
            x = tl.load(p_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            store_weight_rows(source_f32(x, UPCAST), rows, cols, inverse, e, N, K, q_ptr,
                              qt_ptr, True, True, fp32, UPCAST)  # fmt: skip
    else:
        parts = ()
        for part in tl.static_range(128 // ROWS):
            rows = nb * 128 + part * ROWS + tl.arange(0, ROWS)
            x, part_max = _update_rows(p_ptr, g_ptr, m_ptr, v_ptr, rows, cols, N, K, stride_n,
                                       stride_k, *hyper, UPCAST)  # fmt: skip
            parts = parts + (x,)
            amax = tl.maximum(amax, part_max)
        scale, inverse = pow2_scale(amax)
        for part in tl.static_range(128 // ROWS):
            rows = nb * 128 + part * ROWS + tl.arange(0, ROWS)
            store_weight_rows(source_f32(parts[part], UPCAST), rows, cols, inverse, e, N, K,
                              q_ptr, qt_ptr, True, True, fp32, UPCAST)  # fmt: skip
    store_weight_scale(scale, e, nb, kb, N, K, s_ptr, st_ptr, True, True)


def _check_operands(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.shape != p.shape or t.stride() != p.stride() or t.device != p.device:
            raise ValueError(
                f"{name} must have the parameter's shape {list(p.shape)}, strides {p.stride()} "
                f"and device {p.device}, got {list(t.shape)}, {t.stride()}, {t.device}"
            )
        if not t.dtype.is_floating_point or t.dtype == FP8:
            raise ValueError(f"{name} must be a bf16/fp16/fp32 tensor, got {t.dtype}")


def adamw_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: AdamWStep
) -> None:
    """One AdamW step of contiguous ``p`` (any float dtype) with gradient ``g`` and moments
    ``m``, ``v`` (same shape and strides), in place."""
    _check_operands(p, g, m, v)
    if not p.is_contiguous():
        raise ValueError(
            f"param must be contiguous, got shape {list(p.shape)} with strides {p.stride()}"
        )
    if p.numel():
        launch(_adamw_kernel, (cdiv(p.numel(), _BLOCK),), p, g, m, v, p.numel(),
               *hyper.scalars(), BLOCK_SIZE=_BLOCK, UPCAST=interpreting())  # fmt: skip


def adamw_quantize_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: AdamWStep
) -> Fp8Weight:
    """One AdamW step of the [E, N, K] weight view ``p`` (e.g. one half of a stacked gate/up
    weight) with ``g``, ``m``, ``v`` of its strides, in place, and the 128x128 fp8 copies of the
    new weight in both layouts (``fp8.quantize_weight(p, transposed=True)``'s bits)."""
    if p.dim() != 3:
        raise ValueError(f"param must be an [E, N, K] weight view, got shape {list(p.shape)}")
    _check_operands(p, g, m, v)
    e, n, k = p.shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    q = empty((e, n, k), FP8, p.device)
    scale = empty((e, nb, kb), torch.float32, p.device)
    q_t = empty((e, k, n), FP8, p.device)
    scale_t = empty((e, kb, nb), torch.float32, p.device)
    if e and n and k:
        launch(_adamw_fp8_kernel, (e, nb, kb), p, g, m, v, n, k, *p.stride(), *hyper.scalars(),
               q, scale, q_t, scale_t, ROWS=_BLOCK_ROWS, REREAD=_BLOCK_REREAD,
               UPCAST=interpreting(),
               num_warps=_BLOCK_WARPS)  # fmt: skip
    return Fp8Weight(q, scale, q_t, scale_t)
