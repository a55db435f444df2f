"""Block-scaled E4M3 quantization (DeepSeek-V3's recipe): device functions, kernels, launchers.

Every block of 128 values (1x128 along a row, 128x1 along a column, or 128x128 of a weight)
gets one fp32 scale that is a power of two, ``2^ceil(log2(amax / 448))`` (UE8M0-valued), and
its values are stored as ``float8_e4m3fn(x / scale)``: round to nearest even, saturating at
+-448. Dividing by a power of two is exact, so the bytes are those of torch's
``(x.float() / scale).to(torch.float8_e4m3fn)`` and dequantizing (``q * scale``) is exact too.

Scale rule, exactly (``pow2_scale``): the exponent is clamped to at least -126 (the scale and
its inverse stay normal fp32; this only changes blocks whose amax is below about 2^-118), a
block of zeros gets scale 1, and a block holding +-inf gets scale +inf. Non-finite values never
become finite: a NaN is NaN after quantization (its block's scale ignores it), and a block with
an inf quantizes to NaN at the infs and 0 elsewhere, so it dequantizes to NaN everywhere.

Layouts (all row-major data; scales stored with the row index contiguous, "MN-major", so a
tile's scales are one contiguous load):
  * ``quantize_rows(x [M, K])``: 1x128 blocks along K: q [M, K], scale [M, ceil(K/128)] (a
    transposed view: ``scale.t()`` is contiguous). The GEMMs' A operand (activations, d_y).
  * ``quantize_cols(x [M, K])``: 128x1 blocks along M, written transposed: q_t [K, M] = the
    quantized x^T, scale [K, ceil(M/128)] (``scale.t()`` contiguous). The weight gradient's
    operands, whose reduction runs over rows: fp8 wgmma wants it contiguous (K-major).
  * ``quantize_rows_cols(x)``: both of the above from one read of x, for an operand of a data
    gradient and a weight gradient (d_z, d_g, d_u).
  * ``quantize_weight(w [E, N, K])``: 128x128 blocks: q [E, N, K], scale [E, ceil(N/128),
    ceil(K/128)] (contiguous); with ``transposed=True`` also q_t [E, K, N] = q transposed per
    expert and scale_t [E, ceil(K/128), ceil(N/128)] (square blocks transpose exactly), or with
    ``plain=False`` only those. q is the forward's B operand (``nn.Linear`` layout is
    K-major); q_t is the data-gradient's.

The Triton 3.6 interpreter's fp32 -> fp8 conversion drops rounding carries, rounds ties away
and does not saturate, its fp8 -> fp32 conversion reads NaN as 480 and its bf16 -> fp32
conversion flushes subnormals; under the interpreter (``UPCAST``, as in ``tiles``)
``to_e4m3``, ``from_e4m3`` and ``source_f32`` work on the bits instead. On the GPU they are
the hardware conversions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .runtime import cdiv, empty, interpreting, launch

__all__ = [
    "E4M3_MAX",
    "BLOCK",
    "Fp8Weight",
    "to_e4m3",
    "from_e4m3",
    "source_f32",
    "pow2_scale",
    "block_amax",
    "load_quantized_rows",
    "row_blocks",
    "col_blocks",
    "col_blocks_of",
    "store_row_blocks",
    "store_col_blocks",
    "store_weight_rows",
    "store_weight_scale",
    "quantize_rows",
    "quantize_cols",
    "quantize_rows_cols",
    "rows_cols_buffers",
    "UsedRows",
    "block_in_use",
    "quantize_weight",
    "PACK_WORDS",
    "packed_width",
    "quantize_packed",
    "pack_rows",
    "unpack_rows",
    "dequantize_rows",
    "requantize_cols",
]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # values per scale along a blocked dimension
FP8 = torch.float8_e4m3fn

# A packed row's int16 words are a multiple of this (32-byte rows): Triton specializes an int
# argument on its divisibility by 16, so copies of packed rows then move 16-byte vectors.
PACK_WORDS = 16

# Rows (or columns) of one quantization program, a [ROWS, 128] tile of the source (fewer,
# larger programs under the interpreter, where each program costs time of its own). On an H200
# (benchmarks/probes/quantize_tiles.py) these reach 2.6-3.8 TB/s of a bf16 source; requantizing
# fp8 rows into columns is up to 1.13x faster with 64 columns a program than with 32, every
# other choice as fast or slower (same bits: a program's blocks and their arithmetic do not
# change).
_ROWS = {False: 32, True: 128}
_REQUANT_COLS = {False: 64, True: 128}
# Warps of a 128x128 weight block's program: 16 quantize (both layouts) at 3.4-3.5 TB/s on an
# H200, 82-83% of a bf16 copy_ of the weight, 1.03-1.05x 8 warps, 1.3x 4
# (benchmarks/probes/quantize_weights.py; same bits).
_WEIGHT_WARPS = 16
# quantize_rows_cols' 128x128 tile program: its chunk (rows of the 1x128 sweep, columns of the
# 128x1 one) and warps. On an H200 (benchmarks/probes/quantize_rows_cols.py, same bits) 64 and 4
# take 0.78-0.81x the time of the two passes they replace (2.5-2.6 TB/s of their bytes); chunks
# of 32 or 128, or 2 or 8 warps, are 12-34% slower, and the tile loaded once with 16 warps 1.8x.
_ROWS_COLS_CHUNK = 64
_ROWS_COLS_WARPS = 4


class Fp8Weight(NamedTuple):
    """A 128x128-block quantized [E, N, K] weight; ``q_t``/``scale_t`` (its per-expert
    transpose) only when asked for. (A backward's copy restored from saved tensors has only
    the transpose: q and scale None, ``backends.fp8_weights.from_transposed``, as has one
    quantized for a backward alone, ``quantize_weight(..., plain=False)``.)"""

    q: torch.Tensor | None  # float8_e4m3fn [E, N, K]
    scale: torch.Tensor | None  # float32 [E, ceil(N/128), ceil(K/128)]
    q_t: torch.Tensor | None = None  # float8_e4m3fn [E, K, N]
    scale_t: torch.Tensor | None = None  # float32 [E, ceil(K/128), ceil(N/128)]


class UsedRows(NamedTuple):
    """The rows of a row layout that hold data, read on the device: of each ``period`` rows of a
    source (one layout, or several stacked), the first ``num_blocks * block_rows``
    (``RowSchedule.num_blocks`` and ``block_rows``: a layout's buffers are sized for the worst
    case, W times the balanced rows at W > 1 without a capacity). A pass given it skips the
    128-row blocks past them whole (nothing reads them), so it moves the bytes of the rows
    used; their outputs stay unwritten. ``block_rows`` must be a multiple of 128 (fp8 layers'
    are)."""

    num_blocks: torch.Tensor  # int32 [1]
    block_rows: int
    period: int


@triton.jit
def _e4m3_emulated(x):
    """float8e4nv of fp32 ``x`` from its bits: the byte torch's conversion gives (nearest even,
    +-448 for larger magnitudes and inf, NaN keeps its sign)."""
    sign = ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    a = tl.abs(x)
    is_nan = a != a
    a = tl.where(is_nan, 0.0, tl.minimum(a, 448.0))  # saturate (inf too); NaN is set below
    # Normal range [2^-6, 448]: keep 3 mantissa bits, nearest even (a carry bumps the exponent).
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    # Subnormal range: multiples of 2^-9; adding 2^23 rounds a * 2^9 to an integer, nearest even
    # (8 is 2^-6, the smallest normal, whose byte is 8 as well).
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    byte = tl.where(a >= 0.015625, normal, sub)
    byte = tl.where(is_nan, 0x7F, byte) | sign
    return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def to_e4m3(x, UPCAST: tl.constexpr):
    """fp32 tile -> float8e4nv: round to nearest even, saturate to +-448, NaN stays NaN
    (emulated bit by bit under the interpreter)."""
    if UPCAST:
        return _e4m3_emulated(x)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def _e4m3_to_f32_emulated(q):
    """fp32 of float8e4nv ``q`` from its bits (the interpreter reads the NaN byte as 480)."""
    byte = q.to(tl.uint8, bitcast=True).to(tl.int32)
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    value = tl.where((byte & 0x7F) == 0x7F, float("nan"), value)
    sign = (byte & 0x80).to(tl.uint32) << 24
    return (value.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def from_e4m3(q, UPCAST: tl.constexpr):
    """float8e4nv tile -> fp32 (exact; emulated bit by bit under the interpreter)."""
    if UPCAST:
        return _e4m3_to_f32_emulated(q)
    else:
        return q.to(tl.float32)


@triton.jit
def source_f32(x, UPCAST: tl.constexpr):
    """A source tile as fp32, exactly (the interpreter flushes bf16 subnormals: shift the bits)."""
    if UPCAST and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def pow2_scale(amax):
    """(scale, 1 / scale) of blocks with absolute maximum ``amax`` (fp32, >= 0, not NaN):
    ``scale = 2^ceil(log2(amax / 448))`` with the exponent at least -126; 1 for amax 0, +inf
    (inverse 0) for amax inf. Computed from the bits, so it is exact on every device."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = bits >> 23
    # amax = m * 2^(exponent - 127), m in [1, 2); amax <= 448 * 2^n  <=>  n >= e - 8 + (m > 1.75)
    n = exponent - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    n = tl.where(amax == 0.0, 0, tl.maximum(n, -126))
    scale = ((n + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - n) << 23).to(tl.float32, bitcast=True)
    is_inf = exponent == 255
    return tl.where(is_inf, float("inf"), scale), tl.where(is_inf, 0.0, inverse)


@triton.jit
def block_amax(x, axis: tl.constexpr):
    """Absolute maximum along ``axis`` of an fp32 tile, NaN ignored (0 for an all-NaN block)."""
    a = tl.abs(x)
    return tl.max(tl.where(a == a, a, 0.0), axis=axis)


@triton.jit
def block_in_use(row0, used, BOUNDED: tl.constexpr):
    """Whether the 128-row block at row ``row0`` holds used rows: under a :class:`UsedRows`
    ``used`` (num_blocks_ptr, block_rows, period) when ``BOUNDED``, else always."""
    if BOUNDED:
        num_blocks_ptr, block_rows, period = used
        return row0 % period < tl.load(num_blocks_ptr) * block_rows
    else:
        return row0 >= 0


@triton.jit
def load_quantized_rows(
    q_ptr, s_ptr, rows, c0, K, stride_q, stride_s, row_mask, COLS: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """The [len(rows), COLS] fp32 tile at columns c0.. (c0 and COLS multiples of 128, or a
    narrower COLS inside one 128-column block) of 1x128-quantized rows of K columns,
    dequantized (``q * scale``, exact): fp8 ``q`` rows ``stride_q`` apart, their scales
    ``[rows, ceil(K/128)]`` ``stride_s`` apart (e.g. :func:`unpack_rows`' views of packed
    rows); masked entries are 0. Each row's scales are loaded once and broadcast over their
    blocks."""
    cols = c0 + tl.arange(0, COLS)
    mask = row_mask[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    q = tl.load(q_ptr + rows64[:, None] * stride_q + cols[None, :], mask=mask, other=0.0)
    if COLS < 128:  # one block: one scale a row
        scale = tl.load(s_ptr + rows64 * stride_s + c0 // 128, mask=row_mask, other=0.0)
        x = from_e4m3(q, UPCAST) * scale[:, None]
    else:
        blocks = c0 // 128 + tl.arange(0, COLS // 128)
        s_mask = row_mask[:, None] & (blocks * 128 < K)[None, :]
        s_offs = rows64[:, None] * stride_s + blocks[None, :]
        scale = tl.load(s_ptr + s_offs, mask=s_mask, other=0.0)
        x = tl.reshape(from_e4m3(q, UPCAST), [rows.shape[0], COLS // 128, 128])
        x = tl.reshape(x * scale[:, :, None], [rows.shape[0], COLS])
    return x


@triton.jit
def _load_f32_tile(x_ptr, rows, cols, row_ok, col_ok, stride_xm, stride_xk, UPCAST: tl.constexpr):
    """The source tile ``x[rows, cols]`` as fp32, 0 outside ``row_ok`` / ``col_ok``."""
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
    return tl.where(mask, source_f32(tl.load(x_ptr + offs, mask=mask), UPCAST), 0.0)


@triton.jit
def row_blocks(x, UPCAST: tl.constexpr):
    """(q [R, 128], scale [R]) of the fp32 tile ``x [R, 128]`` (one 128-column block, entries
    outside the source 0) quantized 1x128: the arithmetic of every 1x128 quantizer."""
    scale, inverse = pow2_scale(block_amax(x, 1))
    return to_e4m3(x * inverse[:, None], UPCAST), scale


@triton.jit
def col_blocks(x, UPCAST: tl.constexpr):
    """(q_t [C, 128], scale [C]) of the fp32 tile ``x [128, C]`` (one 128-row block, entries
    outside the source 0) quantized 128x1, transposed: the arithmetic of every 128x1
    quantizer."""
    return col_blocks_of(x, block_amax(x, 0), UPCAST)


@triton.jit
def col_blocks_of(x, amax, UPCAST: tl.constexpr):
    """:func:`col_blocks` of rows ``x [R, C]`` of a 128-row block whose columns' absolute
    maxima (over all of the block's rows) are ``amax [C]``: (q_t [C, R], scale [C]). A tile
    split over several warpgroups quantizes each part so, the maxima of the parts combined."""
    scale, inverse = pow2_scale(amax)
    return tl.trans(to_e4m3(x * inverse[None, :], UPCAST)), scale


@triton.jit
def store_row_blocks(x, rows, cols, row_ok, col_ok, q_ptr, s_ptr, stride_qm, stride_sm, s_col,
                     UPCAST: tl.constexpr):  # fmt: skip
    """Quantize the fp32 tile ``x [R, 128]`` 1x128 (:func:`row_blocks`): q at ``q_ptr + row *
    stride_qm + col``, each row's scale at ``s_ptr + row * stride_sm + s_col``; only where
    ``row_ok`` / ``col_ok``."""
    q, scale = row_blocks(x, UPCAST)
    rows64 = rows.to(tl.int64)
    tl.store(
        q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, row_ok[:, None] & col_ok[None, :]
    )
    tl.store(s_ptr + rows64 * stride_sm + s_col, scale, mask=row_ok)


@triton.jit
def store_col_blocks(x, rows, cols, row_ok, col_ok, qt_ptr, s_ptr, stride_qt, stride_sk, s_row,
                     UPCAST: tl.constexpr):  # fmt: skip
    """Quantize the fp32 tile ``x [128, C]`` 128x1 (:func:`col_blocks`) and store it
    transposed: q_t[col, row] at ``qt_ptr + col * stride_qt + row``, each column's scale at
    ``s_ptr + col * stride_sk + s_row``; only where ``row_ok`` / ``col_ok``."""
    q, scale = col_blocks(x, UPCAST)  # [C, 128]
    offs = cols.to(tl.int64)[:, None] * stride_qt + rows[None, :]
    tl.store(qt_ptr + offs, q, mask=col_ok[:, None] & row_ok[None, :])
    tl.store(s_ptr + cols * stride_sk + s_row, scale, mask=col_ok)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    stride_sk,
    ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [ROWS, 128] tile: 1x128 scales along K; q's rows are contiguous, ``stride_qm``
    apart (K, or a packed row's bytes)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    cols = kb * 128 + tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < K
    x = _load_f32_tile(x_ptr, rows, cols, row_ok, col_ok, stride_xm, stride_xk, UPCAST)
    store_row_blocks(
        x, rows, cols, row_ok, col_ok, q_ptr, s_ptr, stride_qm, stride_sm, kb * stride_sk, UPCAST
    )


@triton.jit
def _quantize_cols_kernel(
    x_ptr,
    rs_ptr,
    qt_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_rm,
    stride_rk,
    stride_sk,
    stride_sb,
    used,
    COLS: tl.constexpr,
    DEQUANT: tl.constexpr,
    BOUNDED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [128, COLS] tile: 128x1 scales along M; writes q_t [K, M] (x^T) row-major. With
    ``DEQUANT`` x is fp8 with 1x128 row scales ``rs`` [M, ceil(K/128)], and the values
    quantized are x * rs in fp32 (exact: the scales are powers of two); COLS divides 128, so
    a tile's columns share one row scale. With ``BOUNDED`` only tiles of rows in ``used``
    (:func:`block_in_use`)."""
    mb = tl.program_id(0)
    if block_in_use(mb * 128, used, BOUNDED):
        rows = mb * 128 + tl.arange(0, 128)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        row_ok, col_ok = rows < M, cols < K
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask)
        if DEQUANT:
            kb = (tl.program_id(1) * COLS) // 128
            rs = tl.load(rs_ptr + rows64 * stride_rm + kb * stride_rk, mask=row_ok, other=0.0)
            x = from_e4m3(x, UPCAST) * rs[:, None]
        else:
            x = source_f32(x, UPCAST)
        x = tl.where(mask, x, 0.0)
        store_col_blocks(x, rows, cols, row_ok, col_ok, qt_ptr, s_ptr, M, stride_sk,
                         mb * stride_sb, UPCAST)  # fmt: skip


@triton.jit
def _quantize_rows_cols_kernel(src, rows_out, cols_out, K, used, CHUNK: tl.constexpr,
                               BOUNDED: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """One 128x128 tile of ``x [M, K]`` a program (row block ``program_id(0)``, column block
    ``program_id(1)``), both quantizations: 1x128 into q [M, K] and its scales, in [CHUNK, 128]
    row chunks, then 128x1 into q_t [K, M_out] (x^T, rows ``stride_qt`` apart; its columns
    M..M_out-1 those of zero rows) and theirs, in [128, CHUNK] column chunks. The second sweep
    reads the tile again, from L2 (it was just read), so memory reads it once; the chunks keep
    a program small, so many share an SM and their loads overlap.

    ``src`` (x_ptr, M, stride_xm, stride_xk); ``rows_out`` (q_ptr, s_ptr, stride_sm,
    stride_sk), q's rows K apart; ``cols_out`` (qt_ptr, st_ptr, M_out, stride_qt, stride_stk,
    stride_stb). With ``BOUNDED`` only tiles of rows in ``used`` (:func:`block_in_use`)."""
    mb = tl.program_id(0)
    kb = tl.program_id(1)
    if block_in_use(mb * 128, used, BOUNDED):
        x_ptr, M, stride_xm, stride_xk = src
        q_ptr, s_ptr, stride_sm, stride_sk = rows_out
        qt_ptr, st_ptr, M_out, stride_qt, stride_stk, stride_stb = cols_out
        cols = kb * 128 + tl.arange(0, 128)
        col_ok = cols < K
        for c in tl.static_range(128 // CHUNK):
            rows = mb * 128 + c * CHUNK + tl.arange(0, CHUNK)
            row_ok = rows < M
            x = _load_f32_tile(x_ptr, rows, cols, row_ok, col_ok, stride_xm, stride_xk, UPCAST)
            store_row_blocks(x, rows, cols, row_ok, col_ok, q_ptr, s_ptr, K, stride_sm,
                             kb * stride_sk, UPCAST)  # fmt: skip
        rows = mb * 128 + tl.arange(0, 128)
        row_ok = rows < M
        for c in tl.static_range(128 // CHUNK):
            chunk = kb * 128 + c * CHUNK + tl.arange(0, CHUNK)
            chunk_ok = chunk < K
            x = _load_f32_tile(x_ptr, rows, chunk, row_ok, chunk_ok, stride_xm, stride_xk,
                               UPCAST)  # fmt: skip
            store_col_blocks(x, rows, chunk, rows < M_out, chunk_ok, qt_ptr, st_ptr, stride_qt,
                             stride_stk, mb * stride_stb, UPCAST)  # fmt: skip


@triton.jit
def store_weight_rows(x, rows, cols, inverse, e, N, K, q_ptr, qt_ptr, PLAIN: tl.constexpr,
                      TRANSPOSED: tl.constexpr, FP32_SOURCE: tl.constexpr,
                      UPCAST: tl.constexpr):  # fmt: skip
    """Quantize ``x``, fp32 rows ``rows`` x columns ``cols`` of expert ``e`` of an [E, N, K]
    weight (all or part of one 128x128 block; values past N or K zero), by the block's
    ``inverse`` scale: into ``q_ptr`` [E, N, K] (``PLAIN``) and transposed into ``qt_ptr``
    [E, K, N] (``TRANSPOSED``), contiguous. The weight quantizer's and the optimizer's
    (``kernels.adamw``) one code; :func:`store_weight_scale` writes the block's scale.

    ``FP32_SOURCE``: ``x`` was loaded from fp32 values. Triton 3.6 on Hopper transposes an
    fp8 tile in that layout wrongly (``tl.trans``: about half the bytes misplaced; the GPU
    tests of ``quantize_weight`` and ``megamoe.optim.AdamW`` caught it), so such a tile is
    stored at transposed addresses instead (byte stores: slower, the same bits)."""
    q = to_e4m3(x * inverse, UPCAST)
    base = e.to(tl.int64) * N * K
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    if PLAIN:
        tl.store(q_ptr + base + rows[:, None] * K + cols[None, :], q, mask=mask)
    if TRANSPOSED:
        if FP32_SOURCE:
            tl.store(qt_ptr + base + cols[None, :] * N + rows[:, None], q, mask=mask)
        else:
            t_mask = (cols < K)[:, None] & (rows < N)[None, :]
            tl.store(qt_ptr + base + cols[:, None] * N + rows[None, :], tl.trans(q), mask=t_mask)


@triton.jit
def store_weight_scale(scale, e, nb, kb, N, K, s_ptr, st_ptr,
                       PLAIN: tl.constexpr, TRANSPOSED: tl.constexpr):  # fmt: skip
    """Block (``nb``, ``kb``)'s scale into ``s_ptr`` [E, ceil(N/128), ceil(K/128)] and its
    transposed place in ``st_ptr`` [E, ceil(K/128), ceil(N/128)]."""
    nbs = tl.cdiv(N, 128)
    kbs = tl.cdiv(K, 128)
    if PLAIN:
        tl.store(s_ptr + (e * nbs + nb) * kbs + kb, scale)
    if TRANSPOSED:
        tl.store(st_ptr + (e * kbs + kb) * nbs + nb, scale)


@triton.jit
def _quantize_weight_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    N,
    K,
    stride_we,
    stride_wn,
    stride_wk,
    PLAIN: tl.constexpr,  # write q and its scales
    TRANSPOSED: tl.constexpr,  # write q_t and its scales
    UPCAST: tl.constexpr,
):
    """One 128x128 block (expert e, row block nb, column block kb): one scale."""
    e = tl.program_id(0)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    rows = nb * 128 + tl.arange(0, 128)
    cols = kb * 128 + tl.arange(0, 128)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    x = tl.load(
        w_ptr + e.to(tl.int64) * stride_we + rows[:, None] * stride_wn + cols[None, :] * stride_wk,
        mask=mask,
    )
    x = tl.where(mask, source_f32(x, UPCAST), 0.0)
    scale, inverse = pow2_scale(tl.max(block_amax(x, 1), axis=0))
    store_weight_rows(x, rows, cols, inverse, e, N, K, q_ptr, qt_ptr, PLAIN, TRANSPOSED,
                      w_ptr.dtype.element_ty == tl.float32, UPCAST)  # fmt: skip
    store_weight_scale(scale, e, nb, kb, N, K, s_ptr, st_ptr, PLAIN, TRANSPOSED)


def _check_source(name: str, x: torch.Tensor, dims: int) -> None:
    if x.dim() != dims or not x.dtype.is_floating_point or x.dtype == FP8:
        raise ValueError(
            f"{name} must be a {dims}-D bf16/fp16/fp32 tensor, got {x.dtype} {list(x.shape)}"
        )


def _quantize_rows_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Launch the 1x128 quantization of ``x [M, K]`` into ``q`` (rows contiguous, any row
    stride) and ``scale`` (any strides)."""
    m, k = x.shape
    if m and k:
        rows = _ROWS[interpreting()]
        launch(
            _quantize_rows_kernel,
            (cdiv(m, rows), cdiv(k, BLOCK)),
            x,
            q,
            scale,
            m,
            k,
            x.stride(0),
            x.stride(1),
            q.stride(0),
            scale.stride(0),
            scale.stride(1),
            ROWS=rows,
            UPCAST=interpreting(),
            num_warps=4,
        )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 blocks along the rows of ``x [M, K]``: (q float8_e4m3fn [M, K], scale float32
    [M, ceil(K/128)]); ``scale`` is a transposed view (``scale.t()`` is contiguous). Any K: the
    last block of a row may be partial."""
    _check_source("x", x, 2)
    m, k = x.shape
    q = empty((m, k), FP8, x.device)
    scale = empty((cdiv(k, BLOCK), m), torch.float32, x.device).t()
    _quantize_rows_into(x, q, scale)
    return q, scale


def _used_args(used: UsedRows | None, m: int, anchor: torch.Tensor) -> tuple[tuple, bool]:
    """(the kernels' ``used`` argument, BOUNDED) of a pass over ``m`` rows: ``used`` checked,
    or a placeholder (``anchor``'s pointer) without a bound."""
    if used is None:
        return (anchor, 1, 1), False
    if not isinstance(used, UsedRows):
        raise TypeError(f"used must be a UsedRows or None, got {type(used).__name__}")
    num_blocks, block_rows, period = used
    if (
        not isinstance(num_blocks, torch.Tensor)
        or num_blocks.dtype != torch.int32
        or num_blocks.numel() != 1
        or num_blocks.device != anchor.device
    ):
        raise ValueError(
            f"used.num_blocks must be a one-element int32 tensor on {anchor.device}, got "
            f"{getattr(num_blocks, 'dtype', type(num_blocks).__name__)} "
            f"{list(getattr(num_blocks, 'shape', []))} on {getattr(num_blocks, 'device', None)}"
        )
    if not isinstance(block_rows, int) or block_rows < 1 or block_rows % BLOCK:
        raise ValueError(f"used.block_rows must be a multiple of {BLOCK}, got {block_rows!r}")
    if not isinstance(period, int) or period < 1 or period % BLOCK or m % period:
        raise ValueError(
            f"used.period must be a multiple of {BLOCK} that divides the source's {m} rows, "
            f"got {period!r}"
        )
    return (num_blocks, block_rows, period), True


def _quantize_cols_launch(
    x: torch.Tensor, row_scale: torch.Tensor | None, used: UsedRows | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_t, scale) of the 128x1 quantization of ``x``, or with ``row_scale`` of the values
    ``x * row_scale`` of fp8 rows ``x``; with ``used`` of its used rows only."""
    m, k = x.shape
    used_args, bounded = _used_args(used, m, x)
    mb = cdiv(m, BLOCK)
    q_t = empty((k, m), FP8, x.device)
    scale = empty((mb, k), torch.float32, x.device).t()
    rs = x if row_scale is None else row_scale
    if m and k:
        # (each divides 128, as DEQUANT needs)
        cols = (_ROWS if row_scale is None else _REQUANT_COLS)[interpreting()]
        launch(
            _quantize_cols_kernel,
            (mb, cdiv(k, cols)),
            x,
            rs,
            q_t,
            scale,
            m,
            k,
            x.stride(0),
            x.stride(1),
            rs.stride(0),
            rs.stride(1),
            scale.stride(0),
            scale.stride(1),
            used_args,
            COLS=cols,
            DEQUANT=row_scale is not None,
            BOUNDED=bounded,
            UPCAST=interpreting(),
            num_warps=4,
        )
    return q_t, scale


def quantize_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x1 blocks along the columns of ``x [M, K]``, written transposed: (q_t
    float8_e4m3fn [K, M] = quantized x^T, scale float32 [K, ceil(M/128)]); ``scale`` is a
    transposed view (``scale.t()`` [ceil(M/128), K] is contiguous). The same as
    ``quantize_rows(x.t())``, reading ``x`` in place."""
    _check_source("x", x, 2)
    return _quantize_cols_launch(x, None)


def quantize_rows_cols(
    x: torch.Tensor,
    pad_to: int = 1,
    cols_out: torch.Tensor | None = None,
    used: UsedRows | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(quantize_rows(x), quantize_cols(x'))`` in one pass over ``x [M, K]``, ``x'`` being
    ``x`` with zero rows appended up to a multiple of ``pad_to`` rows (so q_t is [K, M'] with
    zero columns after M): for an operand that both a data gradient (1x128) and a weight
    gradient (128x1) read, it is read from memory once instead of twice (its second sweep over
    each tile hits L2). The same bits as the two calls (each 128x128 tile holds whole blocks
    of both).

    ``cols_out``: the 128x1 quantization goes into these packed rows of x'^T ([K,
    packed_width(M')] int16, :func:`pack_rows`' layout; one tensor to keep for a backward) and
    its (q_t, scale) are their :func:`unpack_rows` views.

    ``used``: only the used rows of a row layout (:class:`UsedRows`) are read and quantized."""
    _check_source("x", x, 2)
    m, k = x.shape
    used_args, bounded = _used_args(used, m, x)
    (q, scale), (q_t, scale_t), m_out = rows_cols_buffers(m, k, x.device, pad_to, cols_out)
    mb, kb = cdiv(m_out, BLOCK), cdiv(k, BLOCK)
    if m_out and k:
        launch(
            _quantize_rows_cols_kernel,
            (mb, kb),
            (x, m, x.stride(0), x.stride(1)),
            (q, scale, scale.stride(0), scale.stride(1)),
            (q_t, scale_t, m_out, q_t.stride(0), scale_t.stride(0), scale_t.stride(1)),
            k,
            used_args,
            CHUNK=_ROWS_COLS_CHUNK,
            BOUNDED=bounded,
            UPCAST=interpreting(),
            num_warps=_ROWS_COLS_WARPS,
        )
    return (q, scale), (q_t, scale_t)


def rows_cols_buffers(
    m: int, k: int, device: torch.device, pad_to: int = 1, cols_out: torch.Tensor | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], int]:
    """The outputs of :func:`quantize_rows_cols` of an ``[m, k]`` source, not yet written:
    ``(q, scale), (q_t, scale_t)`` in its layouts (into ``cols_out``'s packed rows, whose
    padding words are zeroed here) and M' (``m`` padded to ``pad_to``); the fused forward's h
    tasks write them too, with :func:`row_blocks` / :func:`col_blocks` (the same bits)."""
    if not isinstance(pad_to, int) or pad_to < 1:
        raise ValueError(f"pad_to must be a positive int, got {pad_to!r}")
    m_out = cdiv(m, pad_to) * pad_to
    mb, kb = cdiv(m_out, BLOCK), cdiv(k, BLOCK)
    q = empty((m, k), FP8, device)
    scale = empty((kb, m), torch.float32, device).t()
    if cols_out is None:
        q_t = empty((k, m_out), FP8, device)
        scale_t = empty((mb, k), torch.float32, device).t()
    else:
        q_t, scale_t = unpack_rows(_packed_out(cols_out, k, m_out, device, "cols_out"), m_out)
        _zero_tail(cols_out, m_out)
    return (q, scale), (q_t, scale_t), m_out


def _check_quantized(q: torch.Tensor, scale: torch.Tensor) -> None:
    """``q [M, K]`` fp8 and its 1x128 scales ``[M, ceil(K/128)]`` fp32 (any strides)."""
    if q.dtype != FP8 or q.dim() != 2:
        raise ValueError(f"q must be a 2-D float8_e4m3fn tensor, got {q.dtype} {list(q.shape)}")
    expected = [q.shape[0], cdiv(q.shape[1], BLOCK)]
    if scale.dtype != torch.float32 or list(scale.shape) != expected:
        raise ValueError(
            f"scale must be a float32 {expected} tensor (one scale per row and 128 columns of "
            f"q), got {scale.dtype} {list(scale.shape)}"
        )


def requantize_cols(
    q: torch.Tensor, scale: torch.Tensor, used: UsedRows | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_cols`` of the values ``q * scale`` of 1x128-quantized rows (``q [M, K]`` fp8,
    ``scale [M, ceil(K/128)]``, any strides: e.g. :func:`unpack_rows`' views), in one pass.

    The dequantized values are exact in fp32 (the scales are powers of two), so this is
    ``quantize_cols(dequantize_rows(q, scale))`` bit for bit, without the [M, K] fp32
    intermediate. A value ``q * s`` is E4M3 times a power of two; divided by its 128x1 block's
    scale (also a power of two, at least amax / 448) it still is, so it is requantized exactly
    unless it falls into E4M3's subnormal range (below 2^-6 times the new scale: below amax /
    14336 of its column block), where it is rounded to a multiple of 2^-9 times the scale.

    ``used``: only the used rows of a row layout (:class:`UsedRows`) are read and requantized.
    """
    _check_quantized(q, scale)
    return _quantize_cols_launch(q, scale, used)


def dequantize_rows(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale`` of 1x128-quantized rows (``q [M, K]`` fp8, ``scale [M, ceil(K/128)]``) in
    ``dtype``: exact in fp32 (an E4M3 value times a power of two). Torch ops (tests and
    references; the layer's kernels read q and the scales directly)."""
    _check_quantized(q, scale)
    k = q.shape[1]
    return (q.float() * scale.repeat_interleave(BLOCK, dim=1)[:, :k]).to(dtype)


def packed_width(hidden: int) -> int:
    """int16 words of one packed row of ``hidden`` fp8 values: their ``hidden`` bytes, then
    their ceil(hidden/128) float32 scales, padded with zeros to a multiple of PACK_WORDS.
    (A ``torch.SymInt``, a traced size, is taken as it is: the layouts of traced steps.)"""
    symbolic = isinstance(hidden, torch.SymInt)
    if not symbolic and (
        isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 16 or hidden % 16
    ):
        raise ValueError(
            f"hidden must be a positive multiple of 16 (16-byte fp8 rows), got {hidden!r}"
        )
    words = hidden // 2 + 2 * cdiv(hidden, BLOCK)
    return cdiv(words, PACK_WORDS) * PACK_WORDS


def _packed_out(
    out: torch.Tensor | None, m: int, hidden: int, device, name: str = "out"
) -> torch.Tensor:
    width = packed_width(hidden)
    if out is None:
        return empty((m, width), torch.int16, device)
    if out.dtype != torch.int16 or tuple(out.shape) != (m, width) or out.stride(1) != 1:
        raise ValueError(
            f"{name} must be an int16 [{m}, {width}] tensor with contiguous rows (packed_width("
            f"{hidden}) words each), got {out.dtype} {list(out.shape)} strides {out.stride()}"
        )
    return out


def _zero_tail(packed: torch.Tensor, hidden: int) -> torch.Tensor:
    """Zero the padding words of packed rows (every byte of a packed row is determined)."""
    used = hidden + 4 * cdiv(hidden, BLOCK)
    if 2 * packed.shape[1] > used:
        packed.view(torch.uint8)[:, used:].zero_()
    return packed


def unpack_rows(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, hidden], scale float32 [M, ceil(hidden/128)]) of packed rows
    ``[M, packed_width(hidden)]`` int16: views, no copy. Their rows are the packed rows'
    stride apart (the fp8 GEMMs and :func:`requantize_cols` take these strides)."""
    width = packed_width(hidden)
    if (
        packed.dtype != torch.int16
        or packed.dim() != 2
        or packed.shape[1] != width
        or packed.stride(1) != 1
    ):
        raise ValueError(
            f"packed must be an int16 [rows, {width}] tensor with contiguous rows (packed_width("
            f"{hidden})), got {packed.dtype} {list(packed.shape)} strides {packed.stride()}"
        )
    raw = packed.view(torch.uint8)
    kb = cdiv(hidden, BLOCK)
    return raw[:, :hidden].view(FP8), raw[:, hidden : hidden + 4 * kb].view(torch.float32)


def pack_rows(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed rows ``[M, packed_width(K)]`` int16 of 1x128-quantized rows (``q [M, K]`` fp8,
    ``scale [M, ceil(K/128)]``): the bytes of q's row, then its scales, then zeros. Into
    ``out`` when given."""
    _check_quantized(q, scale)
    m, k = q.shape
    packed = _packed_out(out, m, k, q.device)
    q_view, scale_view = unpack_rows(packed, k)
    q_view.copy_(q)
    scale_view.copy_(scale)
    return _zero_tail(packed, k)


def quantize_packed(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_rows(*quantize_rows(x))`` in one pass: ``x [M, K]`` (K a multiple of 16)
    quantized 1x128 straight into packed rows ``[M, packed_width(K)]`` int16 (into ``out``
    when given, e.g. a workspace's ``x_buffer``)."""
    _check_source("x", x, 2)
    m, k = x.shape
    packed = _packed_out(out, m, k, x.device)
    _quantize_rows_into(x, *unpack_rows(packed, k))
    return _zero_tail(packed, k)


def quantize_weight(w: torch.Tensor, *, transposed: bool = False, plain: bool = True) -> Fp8Weight:
    """128x128 blocks of each expert of ``w [E, N, K]`` (any strides, e.g. one half of a
    stacked gate/up weight): q [E, N, K] and scale [E, ceil(N/128), ceil(K/128)], contiguous;
    with ``transposed`` also q_t [E, K, N] (q's bytes transposed) and scale_t [E, ceil(K/128),
    ceil(N/128)], written by the same pass. ``plain`` False (with ``transposed``) writes only
    the transposed copy (q and scale None), for a backward that quantizes for itself."""
    _check_source("w", w, 3)
    if not (plain or transposed):
        raise ValueError(
            "quantize_weight: plain=False asks for the transposed copy only, so "
            "transposed must be True"
        )
    e, n, k = w.shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    q = empty((e, n, k), FP8, w.device) if plain else None
    scale = empty((e, nb, kb), torch.float32, w.device) if plain else None
    q_t = empty((e, k, n), FP8, w.device) if transposed else None
    scale_t = empty((e, kb, nb), torch.float32, w.device) if transposed else None
    if e and n and k:
        launch(
            _quantize_weight_kernel,
            (e, nb, kb),
            w,
            q_t if q is None else q,
            scale_t if scale is None else scale,
            q if q_t is None else q_t,
            scale if scale_t is None else scale_t,
            n,
            k,
            w.stride(0),
            w.stride(1),
            w.stride(2),
            PLAIN=plain,
            TRANSPOSED=transposed,
            UPCAST=interpreting(),
            num_warps=_WEIGHT_WARPS,
        )
    return Fp8Weight(q, scale, q_t, scale_t)
