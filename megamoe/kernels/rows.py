"""Row movement between token order and the expert-contiguous layout (memory-bound kernels).

  gather      xs[r] = x[token(r)]                 (zeros on padding rows)
  combine     y[t]  = sum_k w[t,k] * z[row(t,k)]  (fp32, k in order) + base[t]
  route_grad  dz[r] = w[t,k] * dy[t];  dw[t,k] = <dy[t], z[r]>   (fp32, fixed order)

Expert-parallel variants (same kernels, a constexpr switch, so W > 1 gives the bits of W = 1):
  combine_slots    y[t]  = sum_k w[t,k] * slots[t*K+k] + base[t]  (slots pushed by the owners;
                   NaN everywhere when the step's invalid flag is set)
  route_grad_rows  dz[r] = w[s] * dy_rows[r];  dw_rows[r] = <dy_rows[r], z[r]>  (dy pulled by row)

dy may be packed fp8 rows (``fp8.quantize_packed``, int16): the route grad then reads them
dequantized (exact in fp32) through the same kernel (a constexpr switch) and the same fp32
reduction, so dz and dw are those of the dequantized dy given as fp32. For the fp8 backward
the route grad can quantize dz itself (``quantize=True``): the same kernel's lookups and loads
in 128 x 128 tiles that write dz's 1x128 and 128x1 quantizations (the bits
``fp8.quantize_rows_cols`` gives of the bf16 dz) and never dz, whose write and second read
were the fp8 backward's largest quantization pass.

Only rows of used row blocks are touched; grids are sized for the worst case so the host
never reads the schedule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import fp8
from .runtime import cdiv, check_out, empty, interpreting, launch
from .schedule import RowSchedule
from .tiles import cast, load_rows, store_rows

__all__ = [
    "gather",
    "combine",
    "combine_slots",
    "route_grad",
    "route_grad_rows",
    "QuantizedRows",
]


class QuantizedRows(NamedTuple):
    """A row tile's two fp8 quantizations (``fp8.quantize_rows_cols``' result): ``rows`` =
    (q [M, N], 1x128 scales [M, ceil(N/128)]), ``cols`` = (q_t [N, M], 128x1 scales [N,
    ceil(M/128)])."""

    rows: tuple[torch.Tensor, torch.Tensor]
    cols: tuple[torch.Tensor, torch.Tensor]


# Rows x columns of one program's tile in these memory-bound kernels.
_ROWS = 16
_COLS = 512
_TOKENS = 16
# The fp8 route grad's 128 x 128 tile program (``route_grad(..., quantize=True)``): the rows
# of its chunks (128: the whole tile in one pass) and its warps (docs/tuning.md)
_QUANT_CHUNK = 128
_QUANT_WARPS = 4
# What combine_slots writes when its step is invalid (a bad step must show as a NaN loss): the
# bits of a float32 quiet NaN (a NaN constexpr global would never equal itself, which Triton's
# launcher reads as "changed since compiled").
_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _gather_kernel(
    x_ptr,
    out_ptr,
    row_src_ptr,
    num_blocks_ptr,
    H,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    used = rows < tl.load(num_blocks_ptr) * BLOCK_ROWS
    slot = tl.load(row_src_ptr + rows, mask=used, other=-1)
    col_mask = cols < H
    vals = load_rows(x_ptr, slot // TOP_K, cols, H, used & (slot >= 0), col_mask)
    store_rows(out_ptr, rows, cols, H, vals, used, col_mask, UPCAST)


@triton.jit
def _combine_kernel(
    z_ptr,
    dest_row_ptr,
    w_ptr,
    base_ptr,
    invalid_ptr,
    out_ptr,
    T,
    H,
    TOP_K: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BASE: tl.constexpr,
    IDENTITY: tl.constexpr,
    HAS_INVALID: tl.constexpr,
    TOKENS: tl.constexpr,
    COLS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    tok_mask = tokens < T
    col_mask = cols < H
    acc = tl.zeros([TOKENS, COLS], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = tokens * TOP_K + k
        if IDENTITY:  # z holds one row per slot (the expert-parallel combine buffer)
            row = slot
        else:
            row = tl.load(dest_row_ptr + slot, mask=tok_mask, other=-1)
        val = load_rows(z_ptr, row, cols, H, tok_mask & (row >= 0), col_mask)
        if HAS_WEIGHT:
            val = val * tl.load(w_ptr + slot, mask=tok_mask, other=0.0)[:, None]
        acc += val
    if HAS_BASE:
        acc += load_rows(base_ptr, tokens, cols, H, tok_mask, col_mask)
    if HAS_INVALID:  # int32 word != 0: the inputs are stale (EP capacity overflow), output NaN
        nan = tl.full([1, 1], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        acc = tl.where(tl.load(invalid_ptr) != 0, nan, acc)
    store_rows(out_ptr, tokens, cols, H, acc, tok_mask, col_mask, UPCAST)


@triton.jit
def _route_rows(rows, used, row_src_ptr, w_ptr, TOP_K: tl.constexpr, BY_ROW: tl.constexpr):
    """Of layout rows ``rows`` (``used``: in a used row block): which are real (not padding),
    the dy row each reads (the row itself when dy is in the row layout, ``BY_ROW``, else its
    token), where its dw goes (its row, or its slot) and its routing weight (0 on padding)."""
    slot = tl.load(row_src_ptr + rows, mask=used, other=-1)
    real = used & (slot >= 0)
    if BY_ROW:  # dy already in the row layout (pulled from the source ranks); dw per row
        dy_row = rows
        dw_at = rows
    else:
        dy_row = slot // TOP_K
        dw_at = slot
    return real, dy_row, dw_at, tl.load(w_ptr + slot, mask=real, other=0.0)


@triton.jit
def _dy_tile(dy_ptr, dy_scale_ptr, dy_row, c0, H, stride_dy, stride_dy_scale, real,
             COLS: tl.constexpr, PACKED: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """dy's rows ``dy_row`` at columns c0..c0+COLS in fp32, 0 where not ``real`` or past H:
    bf16 rows, or packed fp8 rows (1x128 scales) dequantized, exactly."""
    if PACKED:
        return fp8.load_quantized_rows(
            dy_ptr, dy_scale_ptr, dy_row, c0, H, stride_dy, stride_dy_scale, real, COLS, UPCAST
        )
    else:
        cols = c0 + tl.arange(0, COLS)
        return load_rows(dy_ptr, dy_row, cols, stride_dy, real, cols < H)


@triton.jit
def _route_grad_kernel(
    dy_ptr,
    dy_scale_ptr,
    z_ptr,
    w_ptr,
    row_src_ptr,
    num_blocks_ptr,
    dz_ptr,
    dw_ptr,
    H,
    stride_dy,
    stride_dy_scale,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BY_ROW: tl.constexpr,
    PACKED: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    used = rows < tl.load(num_blocks_ptr) * BLOCK_ROWS
    real, dy_row, dw_at, w = _route_rows(rows, used, row_src_ptr, w_ptr, TOP_K, BY_ROW)
    dot = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, H, COLS):
        cols = c0 + tl.arange(0, COLS)
        col_mask = cols < H
        dy = _dy_tile(
            dy_ptr, dy_scale_ptr, dy_row, c0, H, stride_dy, stride_dy_scale, real, COLS, PACKED,
            UPCAST,
        )  # fmt: skip
        dot += tl.sum(dy * load_rows(z_ptr, rows, cols, H, real, col_mask), axis=1)
        store_rows(dz_ptr, rows, cols, H, w[:, None] * dy, used, col_mask, UPCAST)
    tl.store(dw_ptr + dw_at, dot, mask=real)


@triton.jit
def _route_grad_fp8_kernel(
    dy_ptr,
    dy_scale_ptr,
    z_ptr,
    w_ptr,
    row_src_ptr,
    num_blocks_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    dot_ptr,
    H,
    M,
    stride_dy,
    stride_dy_scale,
    stride_sk,
    stride_stb,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BY_ROW: tl.constexpr,
    PACKED: tl.constexpr,
    CHUNK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One 128-row block by 128 columns (``kb``) of dz = w * dy, rounded to z's dtype as
    ``_route_grad_kernel`` stores it, quantized as ``fp8.quantize_rows_cols`` quantizes that
    stored dz: 1x128 into q [M, H] (scales ``s_ptr + row + kb * stride_sk``), 128x1 into q_t
    [H, M] (scales ``st_ptr + col + block * stride_stb``); and each row's <dy, z> over the
    block's columns into ``dot[kb, row]``. With CHUNK 128 in one pass over the tile; else in
    two sweeps, of CHUNK rows and then CHUNK columns at a time, as
    ``fp8._quantize_rows_cols_kernel`` makes them (the second reads dy again, from L2)."""
    mb = tl.program_id(0)
    kb = tl.program_id(1)
    if mb * 128 < tl.load(num_blocks_ptr) * BLOCK_ROWS:  # (row blocks are whole 128-row blocks)
        cols = kb * 128 + tl.arange(0, 128)
        col_ok = cols < H
        for c in tl.static_range(128 // CHUNK):
            rows = mb * 128 + c * CHUNK + tl.arange(0, CHUNK)
            used = rows < M
            real, dy_row, _, w = _route_rows(rows, used, row_src_ptr, w_ptr, TOP_K, BY_ROW)
            dy = _dy_tile(
                dy_ptr, dy_scale_ptr, dy_row, kb * 128, H, stride_dy, stride_dy_scale, real, 128,
                PACKED, UPCAST,
            )  # fmt: skip
            dot = tl.sum(dy * load_rows(z_ptr, rows, cols, H, real, col_ok), axis=1)
            tl.store(dot_ptr + kb * M + rows, dot, mask=used)
            dz = _stored(w[:, None] * dy, z_ptr.dtype.element_ty, UPCAST)
            fp8.store_row_blocks(dz, rows, cols, used, col_ok, q_ptr, s_ptr, H, 1,
                                 kb * stride_sk, UPCAST)  # fmt: skip
            if CHUNK == 128:  # the whole tile at once: its columns' blocks too
                fp8.store_col_blocks(dz, rows, cols, used, col_ok, qt_ptr, st_ptr, M, 1,
                                     mb * stride_stb, UPCAST)  # fmt: skip
        if CHUNK < 128:
            rows = mb * 128 + tl.arange(0, 128)
            used = rows < M
            real, dy_row, _, w = _route_rows(rows, used, row_src_ptr, w_ptr, TOP_K, BY_ROW)
            for c in tl.static_range(128 // CHUNK):
                c0 = kb * 128 + c * CHUNK
                chunk = c0 + tl.arange(0, CHUNK)
                dy = _dy_tile(
                    dy_ptr, dy_scale_ptr, dy_row, c0, H, stride_dy, stride_dy_scale, real, CHUNK,
                    PACKED, UPCAST,
                )  # fmt: skip
                dz = _stored(w[:, None] * dy, z_ptr.dtype.element_ty, UPCAST)
                fp8.store_col_blocks(dz, rows, chunk, used, chunk < H, qt_ptr, st_ptr, M, 1,
                                     mb * stride_stb, UPCAST)  # fmt: skip


@triton.jit
def _stored(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 ``x`` as a tensor of ``dtype`` holds it (rounded there and read back, exactly)."""
    return fp8.source_f32(cast(x, dtype, UPCAST), UPCAST)


@triton.jit
def _route_grad_dw_kernel(
    dot_ptr,
    row_src_ptr,
    w_ptr,
    num_blocks_ptr,
    dw_ptr,
    M,
    KB,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BY_ROW: tl.constexpr,
    ROWS: tl.constexpr,
):
    """dw of ``_route_grad_fp8_kernel``'s rows: the sum of each row's KB partial dots in
    column order, at its slot (or row) as ``_route_grad_kernel`` places it."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    used = rows < tl.load(num_blocks_ptr) * BLOCK_ROWS
    real, _, dw_at, _ = _route_rows(rows, used, row_src_ptr, w_ptr, TOP_K, BY_ROW)
    dw = tl.zeros([ROWS], dtype=tl.float32)
    for kb in range(KB):
        dw += tl.load(dot_ptr + kb * M + rows, mask=real, other=0.0)
    tl.store(dw_ptr + dw_at, dw, mask=real)


def gather(x: torch.Tensor, sched: RowSchedule, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> rows [sched.rows, H] in the schedule's layout (rows past the used ones unset).
    ``out``: where to write them (default: a new tensor), a contiguous [sched.rows, H] tensor
    of x's dtype."""
    h = x.shape[1]
    if out is None:
        out = empty((sched.rows, h), x.dtype, x.device)
    else:
        check_out("out", out, (sched.rows, h), x.dtype)
    grid = (sched.rows // _ROWS, cdiv(h, _COLS))
    launch(
        _gather_kernel,
        grid,
        x,
        out,
        sched.row_src,
        sched.num_blocks,
        h,
        TOP_K=sched.top_k,
        BLOCK_ROWS=sched.block_rows,
        ROWS=_ROWS,
        COLS=_COLS,
        UPCAST=interpreting(),
    )
    return out


def _check_invalid(invalid: torch.Tensor | None) -> None:
    if invalid is not None and (invalid.dtype != torch.int32 or invalid.numel() < 1):
        raise ValueError(
            f"invalid must be an int32 tensor with >= 1 element, got "
            f"{invalid.dtype} with {invalid.numel()} elements"
        )


def combine(
    z: torch.Tensor,
    sched: RowSchedule,
    weights: torch.Tensor | None,
    base: torch.Tensor | None,
    out_dtype: torch.dtype,
    invalid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per token, ``sum_k weights[t,k] * z[row(t,k)]`` (fp32, k in order) ``+ base[t]``;
    ``invalid`` as in :func:`combine_slots` (NaN everywhere when the word is set)."""
    _check_invalid(invalid)
    t, h = sched.num_tokens, z.shape[1]
    out = empty((t, h), out_dtype, z.device)
    grid = (cdiv(t, _TOKENS), cdiv(h, _COLS))
    launch(
        _combine_kernel,
        grid,
        z,
        sched.dest_row,
        weights if weights is not None else z,
        base if base is not None else z,
        invalid if invalid is not None else z,
        out,
        t,
        h,
        TOP_K=sched.top_k,
        HAS_WEIGHT=weights is not None,
        HAS_BASE=base is not None,
        IDENTITY=False,
        HAS_INVALID=invalid is not None,
        TOKENS=_TOKENS,
        COLS=_COLS,
        UPCAST=interpreting(),
    )
    return out


def combine_slots(
    slots: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None,
    base: torch.Tensor | None,
    out_dtype: torch.dtype,
    invalid: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`combine` over one row per (token, k): ``slots [T*K, H]``, row ``t*K+k``.

    The expert-parallel epilogue: the experts' owners pushed their rows into these slots. The
    arithmetic is :func:`combine`'s (same kernel), so the result has the same bits.

    ``invalid`` (int32 device word, read by the kernel: no host sync): when it is nonzero the
    slots were not written this step (capacity overflow) and every output element is NaN; when
    it is zero the result is bit-identical to a call without it.
    """
    n, h = slots.shape
    if n % top_k:
        raise ValueError(f"slots must have T*top_k rows, got {n} rows with top_k={top_k}")
    _check_invalid(invalid)
    t = n // top_k
    out = empty((t, h), out_dtype, slots.device)
    grid = (cdiv(t, _TOKENS), cdiv(h, _COLS))
    launch(
        _combine_kernel,
        grid,
        slots,
        slots,
        weights if weights is not None else slots,
        base if base is not None else slots,
        invalid if invalid is not None else slots,
        out,
        t,
        h,
        TOP_K=top_k,
        HAS_WEIGHT=weights is not None,
        HAS_BASE=base is not None,
        IDENTITY=True,
        HAS_INVALID=invalid is not None,
        TOKENS=_TOKENS,
        COLS=_COLS,
        UPCAST=interpreting(),
    )
    return out


def route_grad(
    dy: torch.Tensor,
    z: torch.Tensor,
    weights: torch.Tensor,
    sched: RowSchedule,
    dz: torch.Tensor | None = None,
    dw: torch.Tensor | None = None,
    quantize: bool = False,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """(dz [rows, H] in the layout, zeros on padding rows; dw [T, K] fp32) of the tokens' output
    gradient ``dy``: ``[T, H]``, or its packed fp8 rows ``[T, fp8.packed_width(H)]`` int16
    (``fp8.quantize_packed``), read dequantized (exact in fp32).

    ``dz``, ``dw``: where to write them (default: new tensors; contiguous, of those shapes and
    dtypes). Only the slots of the schedule's real rows are written into ``dw``: the row
    windows of one layout (``schedule.row_window``) fill one ``dw`` between them.

    ``quantize``: dz is never written; in its place come its 1x128 and 128x1 quantizations
    (:class:`QuantizedRows`, the bits ``fp8.quantize_rows_cols`` gives of that dz) for the fp8
    data and weight gradients. dw then sums each row's products per 128 columns first (other
    bits than without ``quantize``; the same by token and by row)."""
    shape = (sched.num_tokens, sched.top_k)
    if dw is None:
        dw = empty(shape, torch.float32, z.device)
    else:
        check_out("dw", dw, shape, torch.float32)
    return _launch_route_grad(dy, z, weights, sched, dw, by_row=False, dz=dz, quantize=quantize)


def route_grad_rows(
    dy_rows: torch.Tensor,
    z: torch.Tensor,
    weights: torch.Tensor,
    sched: RowSchedule,
    dz: torch.Tensor | None = None,
    quantize: bool = False,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """:func:`route_grad` with ``dy`` already in the row layout (pulled unscaled from the peers):
    ``[>= rows, H]``, or packed fp8 rows ``[>= rows, fp8.packed_width(H)]`` int16.

    ``weights`` is indexed by the global slot of each row (every rank's weights, concatenated).
    Returns (dz [rows, H], zeros on padding rows; dw [rows] fp32, set on real rows only), with
    the bits :func:`route_grad` gives for the same rows. ``dz``: where to write dz (default: a
    new tensor; contiguous [rows, H] of z's dtype). ``quantize``: as :func:`route_grad`'s.
    """
    if dy_rows.shape[0] < sched.rows:
        raise ValueError(f"dy_rows must have >= {sched.rows} rows, got {dy_rows.shape[0]}")
    dw = empty(sched.rows, torch.float32, z.device)
    return _launch_route_grad(dy_rows, z, weights, sched, dw, by_row=True, dz=dz, quantize=quantize)


def _launch_route_grad(
    dy: torch.Tensor,
    z: torch.Tensor,
    weights: torch.Tensor,
    sched: RowSchedule,
    dw: torch.Tensor,
    by_row: bool,
    dz: torch.Tensor | None = None,
    quantize: bool = False,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """``_route_grad_kernel`` (or with ``quantize`` ``_route_grad_fp8_kernel`` and
    ``_route_grad_dw_kernel``) over every row block: dy by token (``by_row`` False) or by row;
    int16 ``dy`` is packed fp8 rows (read through ``fp8.unpack_rows``' views)."""
    h = z.shape[1]
    packed = dy.dtype == torch.int16
    if packed:
        dy, dy_scale = fp8.unpack_rows(dy, h)
    elif dy.shape[1] != h or dy.stride(1) != 1:
        raise ValueError(f"dy must have {h} contiguous columns (z's), got {list(dy.shape)}")
    else:
        dy_scale = dy
    rows_args = (dy, dy_scale, z, weights, sched.row_src, sched.num_blocks)
    flags = dict(TOP_K=sched.top_k, BLOCK_ROWS=sched.block_rows, BY_ROW=by_row)
    if quantize:
        if dz is not None:
            raise ValueError("dz: route_grad(quantize=True) writes no dz; pass dz=None")
        if sched.block_rows % fp8.BLOCK:
            raise ValueError(
                f"quantize needs row blocks of a multiple of {fp8.BLOCK} rows (whole 128x1 "
                f"blocks of dz), got block_rows = {sched.block_rows}"
            )
        return _route_grad_quantized(rows_args, h, sched.rows, dw, packed, flags)
    if dz is None:
        dz = empty((sched.rows, h), z.dtype, z.device)
    else:
        check_out("dz", dz, (sched.rows, h), z.dtype)
    launch(
        _route_grad_kernel,
        (sched.rows // _ROWS,),
        *rows_args,
        dz,
        dw,
        h,
        dy.stride(0),
        dy_scale.stride(0),
        PACKED=packed,
        ROWS=_ROWS,
        COLS=_COLS,
        UPCAST=interpreting(),
        **flags,
    )
    return dz, dw


def _route_grad_quantized(
    rows_args: tuple, h: int, m: int, dw: torch.Tensor, packed: bool, flags: dict
) -> tuple[QuantizedRows, torch.Tensor]:
    """The ``quantize`` route grad of :func:`_launch_route_grad`: dz's two quantizations into
    the layouts ``fp8.quantize_rows_cols`` returns, and dw from per-block partial dots."""
    dy, dy_scale, z = rows_args[:3]
    mb, kb = m // fp8.BLOCK, cdiv(h, fp8.BLOCK)
    q = empty((m, h), fp8.FP8, z.device)
    scale = empty((kb, m), torch.float32, z.device).t()
    q_t = empty((h, m), fp8.FP8, z.device)
    scale_t = empty((mb, h), torch.float32, z.device).t()
    dots = empty((kb, m), torch.float32, z.device)
    if m and h:
        launch(
            _route_grad_fp8_kernel,
            (mb, kb),
            *rows_args,
            q,
            scale,
            q_t,
            scale_t,
            dots,
            h,
            m,
            dy.stride(0),
            dy_scale.stride(0),
            scale.stride(1),
            scale_t.stride(1),
            PACKED=packed,
            CHUNK=_QUANT_CHUNK,
            UPCAST=interpreting(),
            num_warps=_QUANT_WARPS,
            **flags,
        )
        launch(
            _route_grad_dw_kernel,
            (m // _ROWS,),
            dots,
            rows_args[4],
            rows_args[3],
            rows_args[5],
            dw,
            m,
            kb,
            ROWS=_ROWS,
            **flags,
        )
    return QuantizedRows((q, scale), (q_t, scale_t)), dw
