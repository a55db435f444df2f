"""Tile-level ``@triton.jit`` device functions shared by every kernel (and the future megakernel).

Each function does one job on one tile: the tile-to-expert mapping of the padded row layout,
loading a weight tile in either stored layout, one MMA step, SwiGLU forward/backward, masked
row gathers/stores, and the bookkeeping of a persistent loop flattened over all of a program's
K steps. Kernels compose these; nothing here launches anything.

``UPCAST`` is a constexpr that is True only under the Triton interpreter, which cannot do bf16
``tl.dot`` or bf16 arithmetic: the same kernel source then multiplies fp32 copies of the tiles.
The interpreter also truncates fp32 -> bf16 conversions; ``cast`` rounds to nearest-even there
first, so interpreter results carry GPU rounding and tests can keep bf16 tolerances.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(acc, a, b, UPCAST: tl.constexpr):
    """``acc += a @ b``, fp32 accumulation of bf16 operands.

    Under the interpreter the tile product is summed in float64 (bf16 products are exact there
    and the order of the sum no longer shows after rounding to fp32): numpy's fp32 matmul sums
    in an order that depends on the tile's width, so the interpreter's bits would otherwise
    change with the tile shape, which on the GPU only splits the outputs."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def cast(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 tile -> ``dtype`` with round-to-nearest-even (emulated under the interpreter)."""
    if UPCAST and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def load_weight_tile(
    desc, expert, k, n, w_rows, BK: tl.constexpr, BN: tl.constexpr, B_KN: tl.constexpr
):
    """The [BK, BN] operand tile of expert ``expert``'s weight at (k, n).

    The weight is viewed 2-D with the experts stacked along the rows, ``w_rows`` rows apart
    (``gemm.weight_2d``): [E*K, N] when it is stored K-major (``B_KN``, e.g. w_down used by
    dgrad) or [E*N, K] when stored N-major (``nn.Linear`` layout used by the forward), in which
    case the loaded [BN, BK] tile is transposed. ``w_rows`` is K or N for a weight of its own,
    2N for either half of a stacked gate/up weight.
    """
    if B_KN:
        return desc.load([expert * w_rows + k, n])
    else:
        return desc.load([expert * w_rows + n, k]).T


@triton.jit
def store_zeros(desc, row, col, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Zero the [ROWS, COLS] box of ``desc``'s tensor at (row, col) (TMA store)."""
    desc.store([row, col], tl.zeros([ROWS, COLS], dtype=desc.dtype))


@triton.jit
def tile_of(tile_id, tiles_n):
    """Row-block and column-block of a tile; the column is the fast index so that programs
    running at the same time share one row block of A (and one expert's weights) in L2."""
    return tile_id // tiles_n, tile_id % tiles_n


@triton.jit
def silu(g):
    """SiLU in fp32."""
    return g / (1.0 + tl.exp(-g))


@triton.jit
def swiglu(g, u):
    """h = silu(g) * u, fp32 in, fp32 out."""
    return silu(g) * u


@triton.jit
def swiglu_backward(dh, g, u):
    """(d_g, d_u) of h = silu(g) * u, all fp32."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    s = g * sig
    dg = dh * u * (sig + s * (1.0 - sig))
    du = dh * s
    return dg, du


@triton.jit
def store_gate_up(g_desc, u_desc, h_desc, row, col, acc_g, acc_u, UPCAST: tl.constexpr):
    """The gate/up epilogue of one tile: g, u and h = silu(g) * u stored at (row, col)."""
    g_desc.store([row, col], cast(acc_g, g_desc.dtype, UPCAST))
    u_desc.store([row, col], cast(acc_u, u_desc.dtype, UPCAST))
    h_desc.store([row, col], cast(swiglu(acc_g, acc_u), h_desc.dtype, UPCAST))


@triton.jit
def store_mm(
    c_desc, c2_desc, g_desc, u_desc, row, col, acc, SWIGLU: tl.constexpr, UPCAST: tl.constexpr
):
    """The grouped-mm epilogue of one tile at (row, col): ``acc`` into c, or with ``SWIGLU``
    (``acc`` is d_h) the SwiGLU backward from the saved (g, u): d_g into c, d_u into c2."""
    if SWIGLU:
        g = g_desc.load([row, col]).to(tl.float32)
        u = u_desc.load([row, col]).to(tl.float32)
        dg, du = swiglu_backward(acc, g, u)
        c_desc.store([row, col], cast(dg, c_desc.dtype, UPCAST))
        c2_desc.store([row, col], cast(du, c2_desc.dtype, UPCAST))
    else:
        c_desc.store([row, col], cast(acc, c_desc.dtype, UPCAST))


@triton.jit
def load_rows(ptr, rows, cols, stride, row_mask, col_mask):
    """Gather a [len(rows), len(cols)] tile of a row-major matrix as fp32; masked entries are 0."""
    offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    vals = tl.load(ptr + offs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    return vals.to(tl.float32)


@triton.jit
def store_rows(ptr, rows, cols, stride, vals, row_mask, col_mask, UPCAST: tl.constexpr):
    """Scatter an fp32 tile into rows ``rows`` of a row-major matrix, rounding to its dtype."""
    offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    tl.store(
        ptr + offs,
        cast(vals, ptr.dtype.element_ty, UPCAST),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def load_scalar(ptr, UPCAST: tl.constexpr):
    """``tl.load(ptr)`` of one int32, on the GPU as an instruction the software pipeliner does
    not see as a load: a TMA load whose coordinates come from a ``tl.load`` in its loop is not
    pipelined (Triton 3.6). (``UPCAST``: under the interpreter, which runs no inline asm.)"""
    if UPCAST:
        return tl.load(ptr)
    else:
        return tl.inline_asm_elementwise(
            "ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def program_steps(steps, E, tiles_per_expert, pid, NUM_PROGS: tl.constexpr,
                  E_POW2: tl.constexpr):  # fmt: skip
    """The K steps of program ``pid``'s tiles in a persistent loop over expert-major tiles (tile
    t is the program's when t % NUM_PROGS == pid, ``tiles_per_expert`` a expert): the sum of
    ``steps [E_POW2]`` (each expert's steps a tile; entries from E on ignored) over them. The
    trip count of a flattened weight-gradient loop."""
    e = tl.arange(0, E_POW2)
    first = e * tiles_per_expert - pid  # the program's tiles below e's first, and below its end
    below = (tl.maximum(first, 0) + NUM_PROGS - 1) // NUM_PROGS
    below_end = (tl.maximum(first + tiles_per_expert, 0) + NUM_PROGS - 1) // NUM_PROGS
    return tl.sum(tl.where(e < E, (below_end - below) * steps, 0))


@triton.jit
def expert_rows(row_start_ptr, counts_ptr, expert, BK: tl.constexpr, UPCAST: tl.constexpr,
                COUNTS: tl.constexpr):  # fmt: skip
    """The rows [begin, end) of ``expert`` a weight-gradient tile sums, read by
    :func:`load_scalar`: its padded rows, or with ``COUNTS`` up to its last real row (from
    ``counts_ptr``) rounded up to the K step, within its padded rows (the padding rows hold
    zeros, so leaving them out changes no bit)."""
    begin = load_scalar(row_start_ptr + expert, UPCAST)
    end = load_scalar(row_start_ptr + expert + 1, UPCAST)
    if COUNTS:
        end = tl.minimum(begin + tl.cdiv(load_scalar(counts_ptr + expert, UPCAST), BK) * BK, end)
    return begin, end


@triton.jit
def tile_steps(row_start_ptr, counts_ptr, expert, BK: tl.constexpr, UPCAST: tl.constexpr,
               COUNTS: tl.constexpr):  # fmt: skip
    """The K steps of a weight-gradient tile of ``expert`` (:func:`expert_rows`); an expert
    without rows takes one step (of zeros)."""
    begin, end = expert_rows(row_start_ptr, counts_ptr, expert, BK, UPCAST, COUNTS)
    return tl.maximum(tl.cdiv(end - begin, BK), 1)


@triton.jit
def next_tile_rows(walk, row_start_ptr, counts_ptr, tiles_per_expert, tiles_n, zero_row,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_PROGS: tl.constexpr,
                   UPCAST: tl.constexpr, COUNTS: tl.constexpr):  # fmt: skip
    """The loads' walk of a flattened weight-gradient loop, ``walk`` = (tile, r, r_end, m0, n0,
    live): the K step at rows r.. of the tile at (m0, n0). When the tile's rows are done it
    enters the program's next tile, reading the schedule there only (no division or load in
    the other steps): the rows of its expert (:func:`expert_rows`), or for an expert without
    rows (``live`` False) one step at ``zero_row``, past every row (TMA reads zeros there)."""
    tile, r, r_end, m0, n0, live = walk
    if r >= r_end:
        tile += NUM_PROGS
        mb, nb = tile_of(tile % tiles_per_expert, tiles_n)
        begin, end = expert_rows(
            row_start_ptr, counts_ptr, tile // tiles_per_expert, BK, UPCAST, COUNTS
        )
        live = begin < end
        r = tl.where(live, begin, zero_row)
        r_end = tl.where(live, end, zero_row + BK)
        m0 = mb * BM
        n0 = nb * BN
    return tile, r, r_end, m0, n0, live


@triton.jit
def next_row_step(walk, block_expert_ptr, tiles_n, k_steps, BM: tl.constexpr, BN: tl.constexpr,
                  BLOCK_TILES: tl.constexpr, NUM_PROGS: tl.constexpr,
                  UPCAST: tl.constexpr):  # fmt: skip
    """The loads' walk of a flattened row-block GEMM loop (``walk`` = (tile, kb, row, col,
    expert): K step kb of the tile at (row, col), whose rows are expert's), one K step on. Past
    the tile's last step it enters the program's next tile, reading the schedule there only
    (no division or load in the other steps). Start it at (pid - NUM_PROGS, k_steps - 1, ...)."""
    tile, kb, row, col, expert = walk
    kb += 1
    if kb == k_steps:
        kb = 0
        tile += NUM_PROGS
        mb, nb = tile_of(tile, tiles_n)
        row = mb * BM
        col = nb * BN
        expert = load_scalar(block_expert_ptr + mb // BLOCK_TILES, UPCAST)
    return tile, kb, row, col, expert
