"""Block-scaled FP8 (E4M3) grouped GEMMs over the padded expert-contiguous row layout.

The same row layout, ``RowSchedule`` and persistent grid as ``gemm``; the operands are the
outputs of ``fp8``'s quantizers: activations with one scale per row and 128 columns (1x128),
weights with one scale per 128x128 block. Every K step is 128 deep, so each step has exactly
one activation scale per row and one weight scale per 128 output columns, and the step's fp32
partial product is promoted into the accumulator on the CUDA cores (DeepSeek-V3's recipe):

    acc += dot(a_q, b_q) * a_scale[:, None] * b_scale[None, :]

The scales are powers of two, so both multiplications are exact (short of leaving fp32's
exponent range): the step rounds once, in the add. Under the interpreter the step's product is
summed in float64, where 128 products of E4M3 values are exact in any order (``tiles.mma``'s
reason), so the bits do not depend on the tile width; on the GPU the tensor cores sum the
step's 128 products at their own precision, in an order fixed by the instruction.

Both operands of every fp8 ``tl.dot`` are K-major (Hopper's fp8 wgmma takes no transposed
operand): A is [rows, K] row-major, B is a weight in ``nn.Linear`` layout [E, N, K] loaded as
[BN, BK] tiles and viewed transposed. So the data gradients use the weights' transposed copies
(``fp8.quantize_weight(..., transposed=True)``), and the weight gradient takes both of its
operands transposed (``fp8.quantize_cols``: [features, rows], the rows contiguous).

  * ``gate_up``: g, u and h = silu(g) * u (fp32 epilogue), stored bf16, like ``gemm.gate_up``.
  * ``grouped_mm``: C = A W_e^T (forward down).
  * ``dgrad_swiglu``: (d_g, d_u) from d_h = dZ W_down_e with the SwiGLU backward epilogue.
  * ``dgrad_pair``: d_x = d_g W_gate_e + d_u W_up_e in one accumulator.
  * ``wgrad``: d_W_e = A_e^T B_e over expert e's rows in order (no split-K, no atomics).

Sizes: K (the reduction) may be any multiple of 16 (fp8 TMA rows must be 16-byte aligned; the
last 128-block may be partial: TMA reads zeros past K), N any multiple of 8 (16-byte output
rows), and the weight gradient needs ``block_rows % 128 == 0`` (each 128-row step stays inside
one expert and one 128x1 scale block). Each is checked with an error naming the argument.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import fp8, fp8_ws
from .fp8 import BLOCK, FP8, Fp8Weight, from_e4m3
from .gemm import GemmTiles, row_tile, weight_2d
from .runtime import cdiv, descriptor, empty, interpreting, launch, launch_grid
from .schedule import RowSchedule
from .tiles import (
    cast,
    load_scalar,
    next_row_step,
    next_tile_rows,
    program_steps,
    store_gate_up,
    store_mm,
    tile_of,
    tile_steps,
)

__all__ = [
    "GPU_TILES",
    "INTERPRETER_TILES",
    "EPILOGUE_QUANTIZES",
    "WARP_SPECIALIZED",
    "WIDE",
    "tiles_for",
    "triton_tiles",
    "fp8_mma",
    "fp8_mm_acc",
    "fp8_mm_acc_split",
    "fp8_half_mma",
    "opaque_zero",
    "fp8_gate_up_tile",
    "fp8_grouped_mm_tile",
    "fp8_wgrad_tile",
    "gate_up",
    "gate_up_quantized",
    "grouped_mm",
    "dgrad_swiglu",
    "dgrad_swiglu_quantized",
    "dgrad_pair",
    "wgrad",
    "used_rows",
]

# Hopper choices (H200), from the interleaved tile sweep (megamoe.tools.sweep_tiles): tiles of
# one warpgroup, two programs per SM (while one program promotes its block-scaled partial
# products on the CUDA cores, the other's MMAs run), the K step the scale block. 128-row tiles
# run as two 64-row halves sharing each B tile (``split_m``: the 128-row tile's operand bytes,
# the 64-row tile's overlap): on every model of the table the data gradients 1.19-1.54x the
# 64-row tiles (2026-12-03), gate/up 1.04-1.35x and the weight gradients 0.96-1.51x (median
# 1.06-1.08x; 2026-12-04). gate/up holds two accumulators a half: 64 wide. The forward down's
# split tile spills unless its halves are strictly ordered (``strict_order``), which costs
# the other split tiles up to 20% but gives it 1.02-1.17x the 64-row tile (2026-12-04).
_SPLIT = GemmTiles(bm=128, bn=128, bk=BLOCK, stages=3, warps=4, programs_per_sm=2, split_m=2)
# The forward down as the warp-specialized Gluon kernel (``fp8_ws``: a TMA producer warp, two
# consumer warpgroups, 128 x 128 tiles, ``stages`` ring slots, one CTA per SM) on Hopper:
# 1.23-1.42x the split tiles below, same bits (4 stages; 3: 1.18-1.29x, 5: as 4; the model
# table's first 7 models at 16384 tokens, H100, 2026-12-06). Where it cannot run (the interpreter,
# other GPUs) the Triton kernel runs the same tile as two strictly ordered halves
# (``strict_order``), one program per SM (two would not fit its 4 stages). ``group_m`` 0: the
# tiles walked in groups of row tiles where an expert's weights would be read again each wave
# (``fp8_ws.walk_group``; gate/up on Llama-4-Scout and Mixtral 1.45-1.49x the column-fast walk).
WARP_SPECIALIZED = dataclasses.replace(
    _SPLIT, stages=4, programs_per_sm=1, strict_order=True, warp_specialized=True, group_m=0
)
# The warp-specialized kernel's wide tiles: 256 columns, a quarter fewer operand bytes a FLOP
# (two 128-column accumulators a consumer, the second block's wgmma after the first one's
# promotion; 3 stages fill the shared memory), the same bits as the 128-column tiles; the row
# tiles walked in groups of 8. The Triton kernels run them as 128-column tiles
# (``triton_tiles``).
WIDE = dataclasses.replace(WARP_SPECIALIZED, bn=256, stages=3, group_m=8)
GPU_TILES: dict[str, GemmTiles] = {
    # gate/up on the warp-specialized kernel's wide tiles: 128 columns of gate and of up (h
    # staged through g's tile), 1.04-1.28x its 64-column tiles (two m64n64 accumulators a
    # consumer, the automatic walk), which were 1.03-1.49x the split tiles; the 15 table
    # models that fit one H100, 16384 tokens, 2026-12-06. The Triton kernels run 64 columns.
    "gate_up": dataclasses.replace(WIDE, bn=128),
    # the forward down and the dgrad of gate/up (two (A, W) pairs into one accumulator) on the
    # warp-specialized kernel's wide tiles (256 columns: two 128-column accumulators a
    # consumer, 3 stages) walked in groups of 8 row tiles: 1.02-1.17x (down) and 1.03-1.20x
    # (pair) its 128-column tiles, which were 1.23-1.42x and 1.00-1.29x the split tiles; the
    # 15 table models that fit one H100, 16384 tokens, 2026-12-06
    "mm": WIDE,
    "pair": WIDE,
    # the SwiGLU backward of the down dgrad on the warp-specialized kernel (its producer loads
    # each tile's g and u by TMA into the consumers' staging tiles): 1.02-1.17x the split tiles
    # on 12 of the 15 table models that fit one H100, 0.94-0.98x on GLM-4.5, DeepSeek-V2 and
    # Qwen3-235B (geometric mean 1.07x; 16384 tokens, 2026-12-06)
    "swiglu_bwd": WARP_SPECIALIZED,
    # the weight gradient on the warp-specialized kernel, its column scales through the
    # ring's shared memory, in wide tiles (256 columns as four 64-column partial accumulators
    # a consumer, 3 stages) or, where those pad the output more, 192 x 128 tiles of three
    # consumers (``bm`` 0: ``fp8_ws.wgrad_tiles`` picks; 1.00-1.15x the wide tiles on the 14
    # table models that fit one H100 at 16384 tokens, geometric mean 1.03x, 2026-12-06). The
    # wide tiles were 1.02-1.28x the 128-column ones there (geometric mean 1.10x) and
    # 1.05-1.14x at the dsv3 and qwen3-30b presets; those were 1.08-1.30x the split tiles
    "wgrad": dataclasses.replace(WARP_SPECIALIZED, bm=0, bn=256, stages=3),
    # into fp32 (``out_dtype``): its [64, 128] fp32 epilogue tile takes a stage's shared memory
    "wgrad_fp32": dataclasses.replace(_SPLIT, stages=2),
}
# Which activations the warp-specialized epilogues quantize instead of storing them in bf16 for
# ``fp8.quantize_rows_cols``' pass (the same bits either way; ``gate_up_quantized``,
# ``dgrad_swiglu_quantized``): h in gate/up's wide tiles, 0.98-1.16x gate/up and the pass
# (geometric mean 1.03x over the presets and the table, H100, 2026-12-06); not d_g and d_u in
# the SwiGLU backward's, 0.45-0.62x the GEMM and the pass on every table model (two outputs
# per 128-column tile: four times h's epilogue work a FLOP, while both consumers' tensor
# cores wait; H100, 2026-12-06).
EPILOGUE_QUANTIZES = {"h": True, "dgdu": False}
# Narrow tiles keep interpreter runs (CPU tests) fast; the K step stays 128, and the split
# tiles stay split (their halves' indexing is tested wherever the GPU runs it).
INTERPRETER_TILES: dict[str, GemmTiles] = {
    name: GemmTiles(
        bn=32,
        bk=BLOCK,
        stages=1,
        warps=4,
        bm=32 if name.startswith("wgrad") else 0,
        split_m=t.split_m,
    )
    for name, t in GPU_TILES.items()
}


def tiles_for(kind: str) -> GemmTiles:
    return (INTERPRETER_TILES if interpreting() else GPU_TILES)[kind]


def warp_specialized(kind: str, device: torch.device, block_rows: int) -> bool:
    """Whether ``kind``'s GEMMs run the warp-specialized kernels (``fp8_ws``) on ``device``:
    their tiles ask for them and this GPU runs them."""
    return tiles_for(kind).warp_specialized and fp8_ws.supported(device, block_rows)


def triton_tiles(kind: str, t: GemmTiles) -> GemmTiles:
    """The tiles the Triton kernels run for ``tiles[kind] = t`` where ``t`` asks for the
    warp-specialized kernel and it cannot run (other GPUs, outputs other than bf16), with the
    same bits: a wide tile as the narrow one (128 columns, gate/up's 64: two such split
    halves' accumulators would not fit), and the SwiGLU backward and the weight gradient as
    the split tiles (the former's halves strictly ordered spill; the split tiles are the
    latter's tuned Triton tiles)."""
    if not t.warp_specialized:
        return t
    if kind in ("swiglu_bwd", "wgrad"):
        return _SPLIT
    narrow = fp8_ws.GATE_UP_COLS.value if kind == "gate_up" else fp8_ws.TILE_COLS.value
    return dataclasses.replace(t, bn=min(t.bn, narrow))


@triton.jit
def opaque_zero(like, UPCAST: tl.constexpr, STRICT: tl.constexpr = False):
    """Zeros of ``like``'s shape computed from ``like`` (an opaque ``mov``), so that the compiler
    cannot set them up before ``like`` exists: a WGMMA accumulator started from them is not
    live while an earlier partial product is. ptxas still folds the ``mov`` into the WGMMA's
    zero input, which drops that order; ``STRICT`` keeps it for real: ``like``'s bits ANDed
    with ``%ctaid.y`` (0 on the persistent kernels' 1-D grids), at one instruction an element."""
    if UPCAST:
        return tl.zeros(like.shape, dtype=tl.float32)
    elif STRICT:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 y; mov.u32 y, %ctaid.y; and.b32 $0, $1, y; }",
            "=r,r",
            [like],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        return tl.inline_asm_elementwise(
            "mov.b32 $0, 0;", "=r,r", [like], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def fp8_mma(acc, a, b, a_scale, b_scale, UPCAST: tl.constexpr, after=None,
            STRICT: tl.constexpr = False):  # fmt: skip
    """``acc += (a @ b) * a_scale * b_scale`` for one 128-deep K step of fp8 tiles: the product
    is accumulated in fp32 (float64 under the interpreter) and promoted with its scales
    (powers of two: both multiplications are exact). With ``after`` the product's accumulator
    starts from ``opaque_zero(after, UPCAST, STRICT)`` (the same sum: +0 plus the products)."""
    if UPCAST:
        a64 = from_e4m3(a, UPCAST).to(tl.float64)
        d = tl.dot(a64, from_e4m3(b, UPCAST).to(tl.float64)).to(tl.float32)
    elif after is None:
        d = tl.dot(a, b)
    else:
        d = tl.dot(a, b, opaque_zero(after, UPCAST, STRICT))
    if len(b_scale.shape) == 0:
        # one weight scale for the tile: the two scales' product per row first, then one FMA
        # per element, rounding as below would (products of powers of two are exact here)
        return acc + d * (a_scale * b_scale)
    else:
        return acc + d * a_scale * b_scale


@triton.jit
def row_scales(s_ptr, row, kb, M, stride_m, stride_k, BM: tl.constexpr):
    """[BM, 1] scales of rows row.. at K block ``kb`` (0 past the M rows)."""
    rows = row + tl.arange(0, BM)
    return tl.load(s_ptr + rows * stride_m + kb * stride_k, mask=rows < M, other=0.0)[:, None]


@triton.jit
def weight_scales(s_ptr, expert, col, kb, N, stride_e, stride_n, stride_k, BN: tl.constexpr):
    """The 128x128-block scales of expert ``expert``'s output columns col.. at K block ``kb``:
    one scalar when the tile lies in one block (BN <= 128), else [1, BN]."""
    base = s_ptr + expert * stride_e + kb * stride_k
    if BN <= 128:
        return tl.load(base + (col // 128) * stride_n)
    else:
        cols = col + tl.arange(0, BN)
        return tl.load(base + (cols // 128) * stride_n, mask=cols < N, other=0.0)[None, :]


@triton.jit
def fp8_mm_acc(
    acc,
    a_desc,
    a_s_ptr,
    b_desc,
    b_s_ptr,
    expert,
    row,
    col,
    w_rows,
    M,
    N,
    K,
    s_am,
    s_ak,
    s_be,
    s_bn,
    s_bk,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``acc += A[row:row+BM] @ W_expert^T`` over all of K in K order, A 1x128-scaled and W
    128x128-scaled; W's 2-D view [E*N, K] has its experts ``w_rows`` rows apart."""
    pair = (a_desc, a_s_ptr, b_desc, b_s_ptr, w_rows)
    scales = (M, N, K, s_am, s_ak, s_be, s_bn, s_bk)
    for kb in range(tl.cdiv(K, BK)):
        acc, _ = fp8_mm_step(acc, acc, pair, expert, row, col, kb, scales, BM, BN, BK, 1, UPCAST)
    return acc


@triton.jit
def fp8_mm_step(acc0, acc1, pair, expert, row, col, kb, scales, HM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, SPLIT_M: tl.constexpr, UPCAST: tl.constexpr,
                STRICT: tl.constexpr = False):  # fmt: skip
    """K step ``kb`` of the tile at (row, col): ``acc0`` (with ``SPLIT_M`` 2 as two HM-row
    halves, ``acc1`` the lower one, sharing the step's B tile) += A W_expert^T. ``pair`` = (A's
    descriptor, its scales, W's descriptor, its scales, W's rows per expert), ``scales`` = (M,
    N, K and the scales' strides)."""
    a_desc, a_s_ptr, b_desc, b_s_ptr, w_rows = pair
    M, N, K, s_am, s_ak, s_be, s_bn, s_bk = scales
    a_rows = (a_desc, a_s_ptr, M, s_am, s_ak)
    k = kb * BK
    sb = weight_scales(b_s_ptr, expert, col, kb, N, s_be, s_bn, s_bk, BN)
    b = b_desc.load([expert * w_rows + col, k]).T
    if SPLIT_M == 2:
        acc0 = fp8_half_mma(acc0, a_rows, row, k, b, sb, acc1, HM, BK, UPCAST, STRICT)
        acc1 = fp8_half_mma(acc1, a_rows, row + HM, k, b, sb, acc0, HM, BK, UPCAST, STRICT)
    else:
        acc0 = fp8_half_mma(acc0, a_rows, row, k, b, sb, None, HM, BK, UPCAST)
    return acc0, acc1


@triton.jit
def fp8_mm_acc_split(
    acc0,
    acc1,
    pair,
    expert,
    row,
    col,
    scales,
    HM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    STRICT: tl.constexpr = False,
):
    """``fp8_mm_acc`` of a 2*HM-row tile as two HM-row halves (accumulators ``acc0``, ``acc1``)
    sharing each K step's B tile: the operand bytes per FLOP of the 2*HM-row tile with one
    half's partial product live at a time (each half's product accumulator is started from the
    other half's last promoted result, so it cannot be set up earlier). The same sums as two
    ``fp8_mm_acc`` tiles. ``pair`` = (A's descriptor, its scales, W's descriptor, its scales,
    W's rows per expert), ``scales`` = (M, N, K and the scales' strides)."""
    for kb in range(tl.cdiv(scales[2], BK)):
        acc0, acc1 = fp8_mm_step(
            acc0, acc1, pair, expert, row, col, kb, scales, HM, BN, BK, 2, UPCAST, STRICT
        )
    return acc0, acc1


@triton.jit
def fp8_half_mma(acc, a_rows, row, k, b, sb, after, HM: tl.constexpr, BK: tl.constexpr,
                 UPCAST: tl.constexpr, STRICT: tl.constexpr = False):  # fmt: skip
    """One half of a split tile's K step: ``acc`` += rows row..row+HM of A (``a_rows`` = its
    descriptor, scales, rows and the scales' strides) at K offset k times the shared B tile,
    the product's accumulator started from ``opaque_zero(after, UPCAST, STRICT)``, the other
    half's latest promoted result, so that one half's partial product is live at a time."""
    a_desc, a_s_ptr, M, s_am, s_ak = a_rows
    sa = row_scales(a_s_ptr, row, k // BK, M, s_am, s_ak, HM)
    return fp8_mma(acc, a_desc.load([row, k]), b, sa, sb, UPCAST, after, STRICT)


@triton.jit
def fp8_gate_up_tile(
    a_desc,
    a_s_ptr,
    bg_desc,
    bg_s_ptr,
    bu_desc,
    bu_s_ptr,
    g_desc,
    u_desc,
    h_desc,
    expert,
    row,
    col,
    w_rows,
    M,
    N,
    K,
    s_am,
    s_ak,
    s_be,
    s_bn,
    s_bk,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT_M: tl.constexpr,
    STRICT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [BM, BN] tile of g = A Wg^T, u = A Wu^T and h = silu(g) * u at (row, col), from
    one pass over A (the gate and up scales share their strides). A device function, so a
    fused kernel can run the same tiles with the same bits. ``SPLIT_M`` 2: as two BM/2-row
    halves sharing each step's two B tiles, the four products started one after the other
    (``opaque_zero``, ``STRICT`` its kind; the descriptors of A, g, u and h then have BM/2-row
    blocks)."""
    HM: tl.constexpr = BM // SPLIT_M
    accs = _zeros4(HM, BN)
    for kb in range(tl.cdiv(K, BK)):
        accs = fp8_gate_up_step(
            accs, a_desc, a_s_ptr, bg_desc, bg_s_ptr, bu_desc, bu_s_ptr, expert, row, col, kb,
            w_rows, M, N, s_am, s_ak, s_be, s_bn, s_bk, HM, BN, BK, SPLIT_M, STRICT, UPCAST,
        )  # fmt: skip
    fp8_gate_up_store(g_desc, u_desc, h_desc, row, col, accs, HM, SPLIT_M, UPCAST)


@triton.jit
def _zeros4(HM: tl.constexpr, BN: tl.constexpr):
    """A gate/up tile's four [HM, BN] fp32 accumulators, zero."""
    z = tl.zeros([HM, BN], dtype=tl.float32)
    return z, z, z, z


@triton.jit
def fp8_gate_up_step(accs, a_desc, a_s_ptr, bg_desc, bg_s_ptr, bu_desc, bu_s_ptr, expert, row,
                     col, kb, w_rows, M, N, s_am, s_ak, s_be, s_bn, s_bk, HM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, SPLIT_M: tl.constexpr,
                     STRICT: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """K step ``kb`` of a gate/up tile: ``accs`` = (g, u) of the upper HM rows and, with
    ``SPLIT_M`` 2, (g, u) of the lower HM rows, the four products started one after the other
    (``opaque_zero``); both halves read the step's two B tiles."""
    acc_g, acc_u, acc_g1, acc_u1 = accs
    k = kb * BK
    sg = weight_scales(bg_s_ptr, expert, col, kb, N, s_be, s_bn, s_bk, BN)
    su = weight_scales(bu_s_ptr, expert, col, kb, N, s_be, s_bn, s_bk, BN)
    bg = bg_desc.load([expert * w_rows + col, k]).T
    bu = bu_desc.load([expert * w_rows + col, k]).T
    sa = row_scales(a_s_ptr, row, kb, M, s_am, s_ak, HM)
    a = a_desc.load([row, k])
    if SPLIT_M == 2:
        acc_g = fp8_mma(acc_g, a, bg, sa, sg, UPCAST, acc_u1, STRICT)
        acc_u = fp8_mma(acc_u, a, bu, sa, su, UPCAST, acc_g, STRICT)
        sa1 = row_scales(a_s_ptr, row + HM, kb, M, s_am, s_ak, HM)
        a1 = a_desc.load([row + HM, k])
        acc_g1 = fp8_mma(acc_g1, a1, bg, sa1, sg, UPCAST, acc_u, STRICT)
        acc_u1 = fp8_mma(acc_u1, a1, bu, sa1, su, UPCAST, acc_g1, STRICT)
    else:
        acc_g = fp8_mma(acc_g, a, bg, sa, sg, UPCAST)
        acc_u = fp8_mma(acc_u, a, bu, sa, su, UPCAST)
    return acc_g, acc_u, acc_g1, acc_u1


@triton.jit
def fp8_gate_up_store(g_desc, u_desc, h_desc, row, col, accs, HM: tl.constexpr,
                      SPLIT_M: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """The gate/up epilogue of a tile's ``accs`` (:func:`fp8_gate_up_step`'s)."""
    acc_g, acc_u, acc_g1, acc_u1 = accs
    store_gate_up(g_desc, u_desc, h_desc, row, col, acc_g, acc_u, UPCAST)
    if SPLIT_M == 2:
        store_gate_up(g_desc, u_desc, h_desc, row + HM, col, acc_g1, acc_u1, UPCAST)


@triton.jit
def fp8_grouped_mm_tile(
    a_desc,
    a_s_ptr,
    b_desc,
    b_s_ptr,
    a2_desc,
    a2_s_ptr,
    b2_desc,
    b2_s_ptr,
    c_desc,
    c2_desc,
    g_desc,
    u_desc,
    expert,
    row,
    col,
    w_rows,
    w2_rows,
    M,
    N,
    K,
    s_am,
    s_ak,
    s_be,
    s_bn,
    s_bk,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    TWO_PAIRS: tl.constexpr,
    SWIGLU_BWD: tl.constexpr,
    SPLIT_M: tl.constexpr,
    STRICT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [BM, BN] output tile at (row, col): C = A W_e^T; with ``TWO_PAIRS`` C = A W_e^T +
    A2 W2_e^T in one accumulator (the pairs share their scales' strides); with ``SWIGLU_BWD``
    the accumulator is d_h and the tile stores (d_g, d_u) into (c, c2) from the saved (g, u).
    ``SPLIT_M`` 2: as two BM/2-row halves (``fp8_mm_acc_split``, ``STRICT`` the kind of its
    ``opaque_zero``; the descriptors of A, A2, C, C2, g and u then have BM/2-row blocks)."""
    HM: tl.constexpr = BM // SPLIT_M
    scales = (M, N, K, s_am, s_ak, s_be, s_bn, s_bk)
    pair = (a_desc, a_s_ptr, b_desc, b_s_ptr, w_rows)
    pair2 = (a2_desc, a2_s_ptr, b2_desc, b2_s_ptr, w2_rows)
    acc0 = tl.zeros([HM, BN], dtype=tl.float32)
    if SPLIT_M == 2:
        acc1 = tl.zeros([HM, BN], dtype=tl.float32)
        acc0, acc1 = fp8_mm_acc_split(
            acc0, acc1, pair, expert, row, col, scales, HM, BN, BK, UPCAST, STRICT
        )
        if TWO_PAIRS:
            acc0, acc1 = fp8_mm_acc_split(
                acc0, acc1, pair2, expert, row, col, scales, HM, BN, BK, UPCAST, STRICT
            )
        store_mm(c_desc, c2_desc, g_desc, u_desc, row, col, acc0, SWIGLU_BWD, UPCAST)
        store_mm(c_desc, c2_desc, g_desc, u_desc, row + HM, col, acc1, SWIGLU_BWD, UPCAST)
    else:
        acc0 = _pass(acc0, pair, expert, row, col, scales, BM, BN, BK, UPCAST)
        if TWO_PAIRS:
            acc0 = _pass(acc0, pair2, expert, row, col, scales, BM, BN, BK, UPCAST)
        store_mm(c_desc, c2_desc, g_desc, u_desc, row, col, acc0, SWIGLU_BWD, UPCAST)


@triton.jit
def _pass(acc, pair, expert, row, col, scales, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """``fp8_mm_acc`` of one (A, W) pair, its arguments grouped as the tile holds them."""
    a_desc, a_s_ptr, b_desc, b_s_ptr, w_rows = pair
    M, N, K, s_am, s_ak, s_be, s_bn, s_bk = scales
    return fp8_mm_acc(
        acc, a_desc, a_s_ptr, b_desc, b_s_ptr, expert, row, col, w_rows, M, N, K, s_am, s_ak,
        s_be, s_bn, s_bk, BM, BN, BK, UPCAST,
    )  # fmt: skip


@triton.jit
def fp8_wgrad_step(acc0, acc1, a_rows, b_rows, m0, n0, r, HM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, SPLIT_M: tl.constexpr, STRICT: tl.constexpr,
                   UPCAST: tl.constexpr):  # fmt: skip
    """One 128-row step at rows r.. of the weight-gradient tile at (m0, n0): ``acc0`` (and with
    ``SPLIT_M`` 2 ``acc1``, the lower half) += A^T[m0.., r..] B[r.., n0..]. ``a_rows``, ``b_rows``
    = (descriptor, scales, rows whose scales are read (0: none, all zero), the scales' strides)
    of A^T and B^T."""
    bt_desc, bt_s_ptr, N, s_bn, s_bk = b_rows
    sb = tl.reshape(row_scales(bt_s_ptr, n0, r // BK, N, s_bn, s_bk, BN), [1, BN])
    b = bt_desc.load([n0, r]).T
    if SPLIT_M == 2:
        acc0 = fp8_half_mma(acc0, a_rows, m0, r, b, sb, acc1, HM, BK, UPCAST, STRICT)
        acc1 = fp8_half_mma(acc1, a_rows, m0 + HM, r, b, sb, acc0, HM, BK, UPCAST, STRICT)
    else:
        acc0 = fp8_half_mma(acc0, a_rows, m0, r, b, sb, None, HM, BK, UPCAST)
    return acc0, acc1


@triton.jit
def fp8_wgrad_store(c_desc, expert, m0, n0, acc0, acc1, HM: tl.constexpr, BN: tl.constexpr,
                    SPLIT_M: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """Store a weight-gradient tile's accumulators (with ``SPLIT_M`` 2 ``acc1`` is the lower
    half)."""
    c_desc.store([expert, m0, n0], cast(acc0, c_desc.dtype, UPCAST).reshape([1, HM, BN]))
    if SPLIT_M == 2:
        c_desc.store([expert, m0 + HM, n0], cast(acc1, c_desc.dtype, UPCAST).reshape([1, HM, BN]))


@triton.jit
def fp8_wgrad_tile(
    at_desc,
    at_s_ptr,
    bt_desc,
    bt_s_ptr,
    c_desc,
    expert,
    m0,
    n0,
    row_begin,
    row_end,
    M,
    N,
    s_am,
    s_ak,
    s_bn,
    s_bk,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT_M: tl.constexpr,
    STRICT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The [BM, BN] tile at (m0, n0) of d_W[expert] = A^T B over the rows [row_begin,
    row_end) in order, 128 a step (padding rows hold zeros), from the transposed operands
    A^T [M, rows] and B^T [N, rows] and their 1x128 scales along the rows. ``SPLIT_M`` 2: as
    two BM/2-high halves sharing each step's B tile (``fp8_half_mma``, ``STRICT`` the kind of
    its ``opaque_zero``; the descriptors of A^T and d_W then have BM/2-row blocks)."""
    HM: tl.constexpr = BM // SPLIT_M
    acc0 = tl.zeros([HM, BN], dtype=tl.float32)
    acc1 = tl.zeros([HM, BN], dtype=tl.float32)
    a_rows = (at_desc, at_s_ptr, M, s_am, s_ak)
    b_rows = (bt_desc, bt_s_ptr, N, s_bn, s_bk)
    for r in range(row_begin, row_end, BK):
        acc0, acc1 = fp8_wgrad_step(
            acc0, acc1, a_rows, b_rows, m0, n0, r, HM, BN, BK, SPLIT_M, STRICT, UPCAST
        )
    fp8_wgrad_store(c_desc, expert, m0, n0, acc0, acc1, HM, BN, SPLIT_M, UPCAST)


@triton.jit
def program_wgrad_steps(row_start_ptr, E, tiles_per_expert, pid, NUM_PROGS: tl.constexpr,
                        BK: tl.constexpr, E_POW2: tl.constexpr):  # fmt: skip
    """The K steps of program ``pid``'s weight-gradient tiles (``tiles.program_steps``): each
    tile sums its expert's rows 128 a step, a tile of an expert with no rows takes one step of
    zeros."""
    e = tl.arange(0, E_POW2)
    begin = tl.load(row_start_ptr + e, mask=e < E, other=0)
    end = tl.load(row_start_ptr + e + 1, mask=e < E, other=0)
    steps = tl.maximum(tl.cdiv(end - begin, BK), 1)
    return program_steps(steps, E, tiles_per_expert, pid, NUM_PROGS, E_POW2)


@triton.jit
def _fp8_gate_up_kernel(
    a_desc,
    a_s_ptr,
    bg_desc,
    bg_s_ptr,
    bu_desc,
    bu_s_ptr,
    g_desc,
    u_desc,
    h_desc,
    block_expert_ptr,
    num_blocks_ptr,
    M,
    N,
    K,
    w_rows,
    s_am,
    s_ak,
    s_be,
    s_bn,
    s_bk,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT_M: tl.constexpr,
    STRICT: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BN)
    num_tiles = tl.load(num_blocks_ptr) * BLOCK_TILES * tiles_n
    if FLATTEN:
        # One loop over the K steps of all the program's tiles, as the grouped mm's
        HM: tl.constexpr = BM // SPLIT_M
        pid = tl.program_id(0)
        k_steps = tl.cdiv(K, BK)
        accs = _zeros4(HM, BN)
        # (the tile from the step index: carrying a walk through the steps, as the grouped
        # mm does, keeps ptxas from fitting gate/up's four accumulators: 308 B spilled)
        for i in range(tl.cdiv(tl.maximum(num_tiles - pid, 0), NUM_PROGS) * k_steps):
            mb, nb = tile_of(pid + (i // k_steps) * NUM_PROGS, tiles_n)
            kb = i % k_steps
            expert = load_scalar(block_expert_ptr + mb // BLOCK_TILES, UPCAST)
            accs = fp8_gate_up_step(
                accs, a_desc, a_s_ptr, bg_desc, bg_s_ptr, bu_desc, bu_s_ptr, expert, mb * BM,
                nb * BN, kb, w_rows, M, N, s_am, s_ak, s_be, s_bn, s_bk, HM, BN, BK, SPLIT_M,
                STRICT, UPCAST,
            )  # fmt: skip
            if kb == k_steps - 1:
                fp8_gate_up_store(
                    g_desc, u_desc, h_desc, mb * BM, nb * BN, accs, HM, SPLIT_M, UPCAST
                )
                accs = _zeros4(HM, BN)
    else:
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS):
            mb, nb = tile_of(tile, tiles_n)
            fp8_gate_up_tile(
                a_desc,
                a_s_ptr,
                bg_desc,
                bg_s_ptr,
                bu_desc,
                bu_s_ptr,
                g_desc,
                u_desc,
                h_desc,
                tl.load(block_expert_ptr + mb // BLOCK_TILES),
                mb * BM,
                nb * BN,
                w_rows,
                M,
                N,
                K,
                s_am,
                s_ak,
                s_be,
                s_bn,
                s_bk,
                BM,
                BN,
                BK,
                SPLIT_M,
                STRICT,
                UPCAST,
            )


@triton.jit
def _fp8_grouped_mm_kernel(
    a_desc,
    a_s_ptr,
    b_desc,
    b_s_ptr,
    a2_desc,
    a2_s_ptr,
    b2_desc,
    b2_s_ptr,
    c_desc,
    c2_desc,
    g_desc,
    u_desc,
    block_expert_ptr,
    num_blocks_ptr,
    M,
    N,
    K,
    w_rows,
    w2_rows,
    s_am,
    s_ak,
    s_be,
    s_bn,
    s_bk,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    TWO_PAIRS: tl.constexpr,
    SWIGLU_BWD: tl.constexpr,
    SPLIT_M: tl.constexpr,
    STRICT: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BN)
    num_tiles = tl.load(num_blocks_ptr) * BLOCK_TILES * tiles_n
    if FLATTEN:
        # One loop over the K steps of all the program's tiles (one (A, W) pair), so that the
        # pipeline runs on from one tile into the next: the next tile's loads are issued
        # during this one's last steps and its epilogue. Everything is a function of the step
        # (the software pipeliner keeps the loads stages ahead of the epilogue).
        tl.static_assert(not TWO_PAIRS, "a flattened grouped mm takes one (A, W) pair")
        HM: tl.constexpr = BM // SPLIT_M
        scales = (M, N, K, s_am, s_ak, s_be, s_bn, s_bk)
        pair = (a_desc, a_s_ptr, b_desc, b_s_ptr, w_rows)
        pid = tl.program_id(0)
        k_steps = tl.cdiv(K, BK)
        acc0 = tl.zeros([HM, BN], dtype=tl.float32)
        acc1 = tl.zeros([HM, BN], dtype=tl.float32)
        walk = (pid - NUM_PROGS, k_steps - 1, 0, 0, 0)  # the loads' (tiles.next_row_step)
        out_tile = pid  # the stores'
        out_kb = 0
        for _ in range(tl.cdiv(tl.maximum(num_tiles - pid, 0), NUM_PROGS) * k_steps):
            walk = next_row_step(walk, block_expert_ptr, tiles_n, k_steps, BM, BN, BLOCK_TILES,
                                 NUM_PROGS, UPCAST)  # fmt: skip
            tile, kb, row, col, expert = walk
            acc0, acc1 = fp8_mm_step(
                acc0, acc1, pair, expert, row, col, kb, scales, HM, BN, BK, SPLIT_M, UPCAST,
                STRICT,
            )  # fmt: skip
            out_kb += 1
            if out_kb == k_steps:
                out_mb, out_nb = tile_of(out_tile, tiles_n)
                out_row = out_mb * BM
                store_mm(
                    c_desc, c2_desc, g_desc, u_desc, out_row, out_nb * BN, acc0, SWIGLU_BWD, UPCAST
                )
                if SPLIT_M == 2:
                    store_mm(
                        c_desc, c2_desc, g_desc, u_desc, out_row + HM, out_nb * BN, acc1,
                        SWIGLU_BWD, UPCAST,
                    )  # fmt: skip
                acc0 = tl.zeros([HM, BN], dtype=tl.float32)
                acc1 = tl.zeros([HM, BN], dtype=tl.float32)
                out_tile += NUM_PROGS
                out_kb = 0
    else:
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS):
            mb, nb = tile_of(tile, tiles_n)
            fp8_grouped_mm_tile(
                a_desc,
                a_s_ptr,
                b_desc,
                b_s_ptr,
                a2_desc,
                a2_s_ptr,
                b2_desc,
                b2_s_ptr,
                c_desc,
                c2_desc,
                g_desc,
                u_desc,
                tl.load(block_expert_ptr + mb // BLOCK_TILES),
                mb * BM,
                nb * BN,
                w_rows,
                w2_rows,
                M,
                N,
                K,
                s_am,
                s_ak,
                s_be,
                s_bn,
                s_bk,
                BM,
                BN,
                BK,
                TWO_PAIRS,
                SWIGLU_BWD,
                SPLIT_M,
                STRICT,
                UPCAST,
            )


@triton.jit
def _fp8_wgrad_kernel(
    at_desc,
    at_s_ptr,
    bt_desc,
    bt_s_ptr,
    c_desc,
    row_start_ptr,
    E,
    M,
    N,
    zero_row,
    s_am,
    s_ak,
    s_bn,
    s_bk,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT_M: tl.constexpr,
    STRICT: tl.constexpr,
    FLATTEN: tl.constexpr,
    E_POW2: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BN)
    tiles_per_expert = tl.cdiv(M, BM) * tiles_n
    if FLATTEN:
        # One loop over the program's K steps of all its tiles, so that the pipeline runs on
        # from one tile into the next (the next tile's loads are issued during this one's last
        # steps and its store). A tile of an expert with no rows reads one step at ``zero_row``,
        # past the rows (TMA reads zeros there), with its scales masked to zero.
        HM: tl.constexpr = BM // SPLIT_M
        pid = tl.program_id(0)
        steps = program_wgrad_steps(row_start_ptr, E, tiles_per_expert, pid, NUM_PROGS, BK, E_POW2)
        acc0 = tl.zeros([HM, BN], dtype=tl.float32)
        acc1 = tl.zeros([HM, BN], dtype=tl.float32)
        # Two walks over the tiles, one placing the loads, the other the stores (the software
        # pipeliner runs the loads stages ahead of the stores, and a value it carries from the
        # first stage into the last one would stop it pipelining the loop). Each reads the
        # schedule only when it enters a tile, so a K step costs no divisions or scalar loads.
        walk = (pid - NUM_PROGS, 0, 0, 0, 0, False)  # the loads' (next_tile_rows)
        out_tile = pid  # the stores'
        first = tl.minimum(pid // tiles_per_expert, E - 1)
        left = tile_steps(row_start_ptr, row_start_ptr, first, BK, UPCAST, False)
        for _ in range(steps):
            walk = next_tile_rows(walk, row_start_ptr, row_start_ptr, tiles_per_expert, tiles_n,
                                  zero_row, BM, BN, BK, NUM_PROGS, UPCAST, False)  # fmt: skip
            tile, r, r_end, m0, n0, live = walk
            # an expert without rows: its scales read as zeros
            a_rows = (at_desc, at_s_ptr, tl.where(live, M, 0), s_am, s_ak)
            b_rows = (bt_desc, bt_s_ptr, tl.where(live, N, 0), s_bn, s_bk)
            acc0, acc1 = fp8_wgrad_step(
                acc0, acc1, a_rows, b_rows, m0, n0, r, HM, BN, BK, SPLIT_M, STRICT, UPCAST
            )
            walk = (tile, r + BK, r_end, m0, n0, live)
            left -= 1
            if left == 0:
                out_expert = out_tile // tiles_per_expert
                out_mb, out_nb = tile_of(out_tile % tiles_per_expert, tiles_n)
                fp8_wgrad_store(
                    c_desc, out_expert, out_mb * BM, out_nb * BN, acc0, acc1, HM, BN, SPLIT_M,
                    UPCAST,
                )  # fmt: skip
                acc0 = tl.zeros([HM, BN], dtype=tl.float32)
                acc1 = tl.zeros([HM, BN], dtype=tl.float32)
                out_tile += NUM_PROGS
                next_expert = tl.minimum(out_tile // tiles_per_expert, E - 1)
                left = tile_steps(row_start_ptr, row_start_ptr, next_expert, BK, UPCAST, False)
    else:
        for tile in tl.range(tl.program_id(0), E * tiles_per_expert, NUM_PROGS):
            expert = tile // tiles_per_expert
            mb, nb = tile_of(tile % tiles_per_expert, tiles_n)
            fp8_wgrad_tile(
                at_desc,
                at_s_ptr,
                bt_desc,
                bt_s_ptr,
                c_desc,
                expert,
                mb * BM,
                nb * BN,
                tl.load(row_start_ptr + expert),
                tl.load(row_start_ptr + expert + 1),
                M,
                N,
                s_am,
                s_ak,
                s_bn,
                s_bk,
                BM,
                BN,
                BK,
                SPLIT_M,
                STRICT,
                UPCAST,
            )


# ------------------------------------------------------------------------------------- host


def _check_rows(name: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """An fp8 [rows, K] operand with its 1x128 scales; returns (rows, K)."""
    if q.dtype != FP8 or q.dim() != 2 or q.stride(1) != 1:
        raise ValueError(
            f"{name} must be a float8_e4m3fn [rows, K] tensor with contiguous rows, got "
            f"{q.dtype} {list(q.shape)} strides {q.stride()}"
        )
    rows, k = q.shape
    if k % 16:
        raise ValueError(
            f"{name} has K = {k} columns; the fp8 GEMMs need K % 16 == 0 (16-byte TMA rows)"
        )
    expected = [rows, cdiv(k, BLOCK)]
    if scale.dtype != torch.float32 or list(scale.shape) != expected:
        raise ValueError(
            f"{name}_scale must be a float32 {expected} tensor (one scale per row and 128 "
            f"columns of {name}), got {scale.dtype} {list(scale.shape)}"
        )
    return rows, k


def _check_weight(
    name: str, w: Fp8Weight, experts: int, k: int, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The [E, N, K] fp8 weight (or its transposed copy) and its 128x128 scales."""
    q, scale = (w.q_t, w.scale_t) if transposed else (w.q, w.scale)
    what = f"{name}.q_t" if transposed else f"{name}.q"
    if q is None or scale is None:
        raise ValueError(
            f"{name} has no transposed copy; quantize it with fp8.quantize_weight(..., "
            "transposed=True) for the data gradients"
        )
    if q.dtype != FP8 or q.dim() != 3 or tuple(q.shape[::2]) != (experts, k):
        raise ValueError(
            f"{what} must be a float8_e4m3fn [{experts}, N, {k}] tensor, got {q.dtype} "
            f"{list(q.shape)}"
        )
    n = q.shape[1]
    if n % 8:
        raise ValueError(
            f"{what} has N = {n} rows per expert; the outputs need N % 8 == 0 (16-byte TMA rows)"
        )
    expected = [experts, cdiv(n, BLOCK), cdiv(k, BLOCK)]
    if scale.dtype != torch.float32 or list(scale.shape) != expected:
        raise ValueError(
            f"{what.replace('.q', '.scale')} must be a float32 {expected} tensor (one scale "
            f"per 128x128 block), got {scale.dtype} {list(scale.shape)}"
        )
    return q, scale


def _like(scale: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``scale`` in ``ref``'s strides (one kernel argument set strides both)."""
    if scale.stride() == ref.stride():
        return scale
    return torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype, device=ref.device).copy_(
        scale
    )


def gate_up(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w_gate: Fp8Weight,
    w_up: Fp8Weight,
    sched: RowSchedule,
    programs: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(g, u, h), each [rows of a, I] in ``out_dtype``: g = A Wg^T and u = A Wu^T of every used
    row block (``a`` 1x128-quantized [rows, H], ``w_gate``/``w_up`` [E, I, H] 128x128-quantized)
    and h = silu(g) * u from the fp32 accumulators. ``programs``: the SMs to fill (default all,
    ``programs_per_sm`` programs on each; the bits never depend on it)."""
    return _gate_up(a, a_scale, w_gate, w_up, sched, programs, out_dtype, False)


def gate_up_quantized(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w_gate: Fp8Weight,
    w_up: Fp8Weight,
    sched: RowSchedule,
    programs: int | None = None,
    arrivals: fp8_ws.RowArrivals | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(g, u, (hq, hq_scale), h_t): :func:`gate_up`'s bf16 g and u, and its h quantized as
    ``fp8.quantize_rows_cols(h, pad_to=16, cols_out=h_t)`` quantizes it (its bits on the used
    rows): 1x128 for the down GEMM, and 128x1 into ``h_t``, the packed rows of h^T ([I,
    packed_width(rows + -rows % 16)] int16) the weight gradient of down reads. On the
    warp-specialized kernel's wide tiles the epilogue quantizes h, which is never stored
    (where I % 16 == 0, as in fp8 layers, and ``EPILOGUE_QUANTIZES["h"]``); elsewhere
    :func:`gate_up` and that pass. With ``arrivals`` the rows of ``a`` arrive while the
    warp-specialized kernel runs (``fp8_ws.RowArrivals``; only that kernel waits for them)."""
    g, u, (hq, h_t) = _gate_up(
        a, a_scale, w_gate, w_up, sched, programs, torch.bfloat16, True, arrivals
    )
    return g, u, hq, h_t


def _gate_up(a, a_scale, w_gate, w_up, sched, programs, out_dtype, quantize_h, arrivals=None):
    """:func:`gate_up`, or with ``quantize_h`` :func:`gate_up_quantized` as (g, u, ((hq,
    hq_scale), h_t)); ``arrivals``: see there."""
    rows, k = _check_rows("a", a, a_scale)
    qg, sg = _check_weight("w_gate", w_gate, sched.num_experts, k, False)
    qu, su = _check_weight("w_up", w_up, sched.num_experts, k, False)
    if qu.shape != qg.shape:
        raise ValueError(f"w_up.q is {list(qu.shape)}, w_gate.q is {list(qg.shape)}")
    su = _like(su, sg)
    t = tiles_for("gate_up")
    bm, block_tiles = row_tile(t, sched.block_rows)
    hm = _sub_rows("gate_up", t, bm)  # the rows of the A and output blocks
    n = qg.shape[1]
    g, u = (empty((rows, n), out_dtype, a.device) for _ in range(2))
    (wg, w_rows), (wu, _) = weight_2d(qg), weight_2d(qu)
    ws = t.warp_specialized and out_dtype == torch.bfloat16
    h_t = None  # with quantize_h: the packed rows of h^T
    if quantize_h:
        h_t = _packed_cols(rows, n, a.device)
    if arrivals is not None and not (ws and fp8_ws.supported(a.device, sched.block_rows)):
        raise ValueError(
            "arrivals: only the warp-specialized gate/up kernel waits for rows that arrive while "
            f"it runs (a Hopper GPU, tiles['gate_up'].warp_specialized); got device "
            f"{a.device} and tiles {t}"
        )
    if ws and fp8_ws.supported(a.device, sched.block_rows):
        # (the wide tiles' epilogue; its fp8 stores by TMA need 16-byte rows: I % 16 == 0,
        # as fp8 layers have)
        if (
            quantize_h
            and EPILOGUE_QUANTIZES["h"]
            and t.bn == fp8_ws.TILE_COLS.value
            and n % 16 == 0
        ):
            hq, cols, _ = fp8.rows_cols_buffers(rows, n, a.device, 16, h_t)
            h, h_quant = None, (hq, cols)
        else:
            h, h_quant = empty((rows, n), out_dtype, a.device), None
        fp8_ws.launch_gate_up(
            a,
            a_scale,
            (wg, sg),
            (wu, su),
            w_rows,
            sched,
            (g, u, h),
            t.stages,
            programs,
            t.group_m,
            t.bn,
            h_quant,
            arrivals,
        )
        return (g, u, (hq, h_t)) if h_quant is not None else _with_h(g, u, h, h_t, sched)
    h = empty((rows, n), out_dtype, a.device)
    t = triton_tiles("gate_up", t)
    work = sched.max_blocks * block_tiles * cdiv(n, t.bn)
    grid = launch_grid(work, a.device, programs, t.programs_per_sm)
    launch(
        _fp8_gate_up_kernel,
        grid,
        descriptor(a, [hm, t.bk]),
        a_scale,
        descriptor(wg, [t.bn, t.bk]),
        sg,
        descriptor(wu, [t.bn, t.bk]),
        su,
        *(descriptor(o, [hm, t.bn]) for o in (g, u, h)),
        sched.block_expert,
        sched.num_blocks,
        rows,
        n,
        k,
        w_rows,
        *a_scale.stride(),
        *sg.stride(),
        BM=bm,
        BN=t.bn,
        BK=t.bk,
        SPLIT_M=t.split_m,
        STRICT=t.strict_order,
        FLATTEN=t.flatten,
        BLOCK_TILES=block_tiles,
        NUM_PROGS=grid[0],
        UPCAST=interpreting(),
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return _with_h(g, u, h, h_t, sched)


def _with_h(g, u, h, h_t, sched):
    """(g, u, h), or with ``h_t`` (packed rows of h^T) (g, u, (h's 1x128 quantization, h_t))
    from ``fp8.quantize_rows_cols``' pass over h's used rows."""
    if h_t is None:
        return g, u, h
    hq, _ = fp8.quantize_rows_cols(h, pad_to=16, cols_out=h_t, used=used_rows(sched, h.shape[0]))
    return g, u, (hq, h_t)


def used_rows(sched: RowSchedule, rows: int) -> fp8.UsedRows | None:
    """The used rows of ``sched``'s layout in a buffer of ``rows`` rows (``fp8.UsedRows``), for
    the quantization passes over it; None where the rows are not whole 128-row blocks (a
    token layout, the shared expert's: every row used)."""
    if rows % fp8.BLOCK or sched.block_rows % fp8.BLOCK:
        return None
    return fp8.UsedRows(sched.num_blocks, sched.block_rows, rows)


def _sub_rows(kind: str, t: GemmTiles, bm: int) -> int:
    """The rows of one sub-tile of a ``bm``-row tile with ``t.split_m``, checked: on the GPU a
    sub-tile is whole 64-row WGMMAs (with 32-row halves the GPU's bits changed)."""
    sub_rows = 8 if interpreting() else 64
    if t.split_m not in (1, 2) or (t.split_m > 1 and bm % (sub_rows * t.split_m)):
        raise ValueError(
            f"tiles[{kind!r}].split_m = {t.split_m} must be 1 or 2 and split the tile's {bm} rows "
            f"into sub-tiles of a multiple of {sub_rows} rows"
        )
    return bm // t.split_m


def _mm_launch(
    kind: str,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: Fp8Weight,
    sched: RowSchedule,
    *,
    transposed: bool,
    names: tuple[str, str] = ("a", "w"),
    a2: tuple[torch.Tensor, torch.Tensor, Fp8Weight] | None = None,
    names2: tuple[str, str] = ("a2", "w2"),
    gu: tuple[torch.Tensor, torch.Tensor] | None = None,
    programs: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    quantize: bool = False,
    stored: fp8_ws.StoredTiles | None = None,
) -> list:
    """The grouped GEMM launches: the outputs in a list, or with ``quantize`` (with ``gu``)
    :func:`dgrad_swiglu_quantized`'s. ``stored``: :func:`grouped_mm`'s."""
    rows, k = _check_rows(names[0], a, a_scale)
    q, s = _check_weight(names[1], w, sched.num_experts, k, transposed)
    n = q.shape[1]
    t = tiles_for(kind)
    wb, w_rows = weight_2d(q)
    shape = (2 if gu is not None else 1, rows, n)
    if out is not None and (
        tuple(out.shape) != shape or not out.is_contiguous() or not out.is_floating_point()
    ):
        raise ValueError(
            f"out must be a contiguous floating {list(shape)} tensor, got {out.dtype} "
            f"{list(out.shape)} strides {out.stride()}"
        )
    dtype = out_dtype if out is None else out.dtype
    pairs = [(a, a_scale, wb, s, w_rows)]
    if a2 is not None:
        a2_q, a2_scale, w2 = a2
        if _check_rows(names2[0], a2_q, a2_scale) != (rows, k):
            raise ValueError(f"{names2[0]} is {list(a2_q.shape)}, {names[0]} is {list(a.shape)}")
        q2, s2 = _check_weight(names2[1], w2, sched.num_experts, k, transposed)
        if q2.shape != q.shape:
            raise ValueError(f"{names2[1]} is {list(q2.shape)}, {names[1]} is {list(q.shape)}")
        wb2, w2_rows = weight_2d(q2)
        pairs.append((a2_q, _like(a2_scale, a_scale), wb2, _like(s2, s), w2_rows))
    if gu is not None:
        for name, x in zip(("g", "u"), gu):
            if tuple(x.shape) != (rows, n):
                raise ValueError(f"{name} must be [{rows}, {n}], got {list(x.shape)}")
    ws = t.warp_specialized and dtype == torch.bfloat16
    if gu is not None:  # (the warp-specialized epilogue loads g and u by TMA into its staging)
        ws = ws and all(x.dtype == dtype and x.stride(1) == 1 for x in gu)
    ws = ws and fp8_ws.supported(a.device, sched.block_rows)
    # (the epilogue's fp8 stores by TMA need 16-byte rows: I % 16 == 0, as fp8 layers have)
    if ws and quantize and EPILOGUE_QUANTIZES["dgdu"] and n % 16 == 0:
        quant = [_rows_cols_out(rows, n, a.device) for _ in range(2)]
        fp8_ws.launch_grouped_mm(pairs, sched, list(gu), t.stages, programs, t.group_m, gu,
                                 t.bn, quant)  # fmt: skip
        return quant
    out = out if out is not None else empty(shape, dtype, a.device)
    outs = list(out)
    if ws:
        fp8_ws.launch_grouped_mm(pairs, sched, outs, t.stages, programs, t.group_m, gu, t.bn,
                                 stored=stored)  # fmt: skip
        return _rows_cols_of(out, sched) if quantize else outs
    if stored is not None:
        raise ValueError(
            "stored: only the warp-specialized kernel (Hopper, bf16 output) counts its stored tiles"
        )
    t = triton_tiles(kind, t)
    bm, block_tiles = row_tile(t, sched.block_rows)
    hm = _sub_rows(kind, t, bm)  # the rows of the A and output blocks
    a_desc = descriptor(a, [hm, t.bk])
    b_desc = descriptor(wb, [t.bn, t.bk])
    a2_desc, a2_s, b2_desc, s2, w2_rows = a_desc, a_scale, b_desc, s, w_rows
    if a2 is not None:
        a2_q, a2_s, wb2, s2, w2_rows = pairs[1]
        a2_desc, b2_desc = descriptor(a2_q, [hm, t.bk]), descriptor(wb2, [t.bn, t.bk])
    c_descs = [descriptor(o, [hm, t.bn]) for o in outs]
    gu_descs = [descriptor(x, [hm, t.bn]) for x in gu] if gu is not None else c_descs * 2
    work = sched.max_blocks * block_tiles * cdiv(n, t.bn)
    grid = launch_grid(work, a.device, programs, t.programs_per_sm)
    launch(
        _fp8_grouped_mm_kernel,
        grid,
        a_desc,
        a_scale,
        b_desc,
        s,
        a2_desc,
        a2_s,
        b2_desc,
        s2,
        c_descs[0],
        c_descs[-1],
        gu_descs[0],
        gu_descs[1],
        sched.block_expert,
        sched.num_blocks,
        rows,
        n,
        k,
        w_rows,
        w2_rows,
        *a_scale.stride(),
        *s.stride(),
        BM=bm,
        BN=t.bn,
        BK=t.bk,
        TWO_PAIRS=a2 is not None,
        SWIGLU_BWD=gu is not None,
        SPLIT_M=t.split_m,
        STRICT=t.strict_order,
        FLATTEN=t.flatten,
        BLOCK_TILES=block_tiles,
        NUM_PROGS=grid[0],
        UPCAST=interpreting(),
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return _rows_cols_of(out, sched) if quantize else outs


def _packed_cols(rows: int, n: int, device: torch.device) -> torch.Tensor:
    """Unwritten packed rows of x^T for an [rows, n] ``x``, its rows padded to 16 (the
    ``cols_out`` of ``fp8.quantize_rows_cols(x, pad_to=16)``)."""
    return empty((n, fp8.packed_width(rows + -rows % 16)), torch.int16, device)


def _rows_cols_out(rows: int, n: int, device: torch.device) -> fp8_ws.Quantized:
    """Unwritten buffers of ``fp8.quantize_rows_cols(x, pad_to=16)`` of an [rows, n] ``x``,
    the 128x1 ones in packed rows (the warp-specialized epilogue's layout)."""
    return fp8.rows_cols_buffers(rows, n, device, 16, _packed_cols(rows, n, device))[:2]


def _rows_cols_of(both: torch.Tensor, sched: RowSchedule) -> list[fp8_ws.Quantized]:
    """``fp8.quantize_rows_cols(x, pad_to=16)`` of each [m, n] half of ``both`` [2, m, n]
    (contiguous; rows in ``sched``'s layout, only the used ones read), in one pass where no
    128-row block straddles the two (m % 128 == 0: the same blocks, the same bits)."""
    _, m, n = both.shape
    used = used_rows(sched, m)
    if m % BLOCK:
        return [fp8.quantize_rows_cols(x, pad_to=16, used=used) for x in both]
    (q, s), (q_t, s_t) = fp8.quantize_rows_cols(both.view(2 * m, n), pad_to=16, used=used)
    b = m // BLOCK
    return [((q[:m], s[:m]), (q_t[:, :m], s_t[:, :b])), ((q[m:], s[m:]), (q_t[:, m:], s_t[:, b:]))]


def grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: Fp8Weight,
    sched: RowSchedule,
    programs: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    stored: fp8_ws.StoredTiles | None = None,
) -> torch.Tensor:
    """C[r] = a[r] @ w[e(r)]^T for ``w`` [E, N, K] (``nn.Linear`` layout; forward down).
    ``stored``: count the tiles as they are stored (:class:`fp8_ws.StoredTiles`,
    :func:`stored_signals` a row block), for a kernel that reads the rows meanwhile; the
    warp-specialized kernel only."""
    how = dict(programs=programs, out_dtype=out_dtype, stored=stored)
    return _mm_launch("mm", a, a_scale, w, sched, transposed=False, **how)[0]


def stored_signals(block_rows: int, n: int) -> int:
    """What a row block adds to a :class:`fp8_ws.StoredTiles` counter in :func:`grouped_mm`
    over ``n`` output columns (its tiles: ``GPU_TILES["mm"]``)."""
    return fp8_ws.stored_signals(block_rows, n, tiles_for("mm").bn)


def dgrad_swiglu(
    dz: torch.Tensor,
    dz_scale: torch.Tensor,
    w_down: Fp8Weight,
    g: torch.Tensor,
    u: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_g, d_u) = SwiGLU backward of d_h = dz @ w_down[e] (w_down [E, H, I] with its
    transposed copy ``q_t`` [E, I, H]; ``dz`` [rows, H] 1x128-quantized; g, u [rows, I]).

    ``out``: a contiguous [2, rows, I] tensor to write them into in its dtype (``out[0]``,
    ``out[1]``, which are returned), e.g. so that one quantizer pass reads both."""
    dg, du = _swiglu_bwd(dz, dz_scale, w_down, g, u, sched, programs, out_dtype, out=out)
    return dg, du


def _swiglu_bwd(dz, dz_scale, w_down, g, u, sched, programs, out_dtype, **how) -> list:
    """The SwiGLU backward's launch (``how``: ``out`` or ``quantize``, :func:`_mm_launch`'s)."""
    return _mm_launch(
        "swiglu_bwd",
        dz,
        dz_scale,
        w_down,
        sched,
        transposed=True,
        names=("dz", "w_down"),
        gu=(g, u),
        programs=programs,
        out_dtype=out_dtype,
        **how,
    )


def dgrad_swiglu_quantized(
    dz: torch.Tensor,
    dz_scale: torch.Tensor,
    w_down: Fp8Weight,
    g: torch.Tensor,
    u: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[fp8_ws.Quantized, fp8_ws.Quantized]:
    """:func:`dgrad_swiglu`'s d_g and d_u, each quantized as ``fp8.quantize_rows_cols(x,
    pad_to=16)`` quantizes it in ``out_dtype`` (its bits on the used rows): ``((q, q_scale),
    (q_t, q_t_scale))``, 1x128 for :func:`dgrad_pair` and 128x1 (q_t: x^T, [I, rows padded
    to 16]) for the weight gradients: :func:`dgrad_swiglu` into one buffer and that pass (one
    for both where rows % 128 == 0), or with ``EPILOGUE_QUANTIZES["dgdu"]`` on the
    warp-specialized kernel (Hopper, bf16, I % 16 == 0, as in fp8 layers) its epilogue, which
    never stores them in bf16."""
    return tuple(_swiglu_bwd(dz, dz_scale, w_down, g, u, sched, programs, out_dtype, quantize=True))


def dgrad_pair(
    dg: torch.Tensor,
    dg_scale: torch.Tensor,
    w_gate: Fp8Weight,
    du: torch.Tensor,
    du_scale: torch.Tensor,
    w_up: Fp8Weight,
    sched: RowSchedule,
    programs: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """d_x rows = dg @ w_gate[e] + du @ w_up[e] in one fp32 accumulator (weights [E, I, H] with
    their transposed copies [E, H, I]; dg, du [rows, I] 1x128-quantized)."""
    return _mm_launch(
        "pair",
        dg,
        dg_scale,
        w_gate,
        sched,
        transposed=True,
        names=("dg", "w_gate"),
        a2=(du, du_scale, w_up),
        names2=("du", "w_up"),
        programs=programs,
        out_dtype=out_dtype,
    )[0]


def wgrad(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """d_W [E, M, N], d_W[e] = a_e^T @ b_e over the rows of expert e, from the transposed
    128x1-quantized operands ``a_t, a_t_scale = fp8.quantize_cols(a)`` (a [rows, M]) and
    ``b_t, b_t_scale = fp8.quantize_cols(b)`` (b [rows, N]); padding rows must be zero.

    ``out``: where to write it (default: a new ``out_dtype`` tensor), e.g. one half of a
    stacked gate/up gradient; any [E, M, N] view with contiguous rows."""
    if sched.block_rows % BLOCK:
        raise ValueError(
            f"sched.block_rows is {sched.block_rows}; the fp8 weight gradient needs a multiple "
            f"of {BLOCK} (each 128-row step inside one expert and one scale block)"
        )
    m, rows = _check_rows("a_t", a_t, a_t_scale)
    n, b_rows = _check_rows("b_t", b_t, b_t_scale)
    if b_rows != rows:
        raise ValueError(f"b_t has {b_rows} rows (columns of b_t), a_t has {rows}")
    e = sched.num_experts
    if n % 8:
        raise ValueError(
            f"b_t has N = {n} rows; the [E, M, N] output needs N % 8 == 0 (16-byte TMA rows)"
        )
    if out is None:
        out = empty((e, m, n), out_dtype, a_t.device)
    elif tuple(out.shape) != (e, m, n) or not out.dtype.is_floating_point or out.stride(2) != 1:
        raise ValueError(
            f"out must be a floating [{e}, {m}, {n}] tensor with contiguous rows, got "
            f"{out.dtype} {list(out.shape)} strides {out.stride()}"
        )
    kind = "wgrad_fp32" if out.element_size() == 4 else "wgrad"
    t = tiles_for(kind)
    if t.warp_specialized and fp8_ws.supported(a_t.device, sched.block_rows):
        if t.bm == 0:  # automatic
            consumers, cols, stages = fp8_ws.wgrad_tiles(m, n, (t.bn, t.stages))
        else:
            consumers, cols, stages = t.bm // fp8_ws.HALF_ROWS.value, t.bn, t.stages
        fp8_ws.launch_wgrad(
            a_t, a_t_scale, b_t, b_t_scale, sched.row_start, out, stages, programs, cols,
            consumers=consumers,
        )  # fmt: skip
        return out
    t = triton_tiles(kind, t)
    hm = _sub_rows(kind, t, t.bm)
    work = e * cdiv(m, t.bm) * cdiv(n, t.bn)
    grid = launch_grid(work, a_t.device, programs, t.programs_per_sm)
    launch(
        _fp8_wgrad_kernel,
        grid,
        descriptor(a_t, [hm, t.bk]),
        a_t_scale,
        descriptor(b_t, [t.bn, t.bk]),
        b_t_scale,
        descriptor(out, [1, hm, t.bn]),
        sched.row_start,
        e,
        m,
        n,
        cdiv(rows, t.bk) * t.bk,  # a K step past the rows: TMA reads zeros there
        *a_t_scale.stride(),
        *b_t_scale.stride(),
        BM=t.bm,
        BN=t.bn,
        BK=t.bk,
        SPLIT_M=t.split_m,
        STRICT=t.strict_order,
        FLATTEN=t.flatten,
        E_POW2=triton.next_power_of_2(e),
        NUM_PROGS=grid[0],
        UPCAST=interpreting(),
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return out
