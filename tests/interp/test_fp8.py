"""Block-scaled E4M3 quantization and FP8 grouped GEMMs under the Triton interpreter.

Quantization is checked bitwise against torch (``(x.float() / scale).to(float8_e4m3fn)`` with
the power-of-two scale computed here in float64), including the interpreter's emulated
conversion itself over a dense sample of fp32 bit patterns. Each GEMM is checked against the
float64 product of the same quantized operands (dequantized: ``q.double() * scale``), with
every buffer poisoned so an element no program wrote shows as NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple
from unittest import mock

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from megamoe.kernels import fp8, fp8_gemm
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.kernels.schedule import RowSchedule, build_row_schedule, uniform_schedule
from support.fp8_reference import (
    ref_quantize_rows,
    ref_quantize_weight,
    ref_scale,
    same_bytes,
)

FP8 = torch.float8_e4m3fn
INF = float("inf")
NAN = float("nan")
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


# ----------------------------------------------------------------------------- torch reference


def dequant_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double().repeat_interleave(128, 1)[:, : q.shape[1]]


def dequant_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return q.double() * s[:, : q.shape[1], : q.shape[2]]


# ------------------------------------------------------------------- the conversions themselves


@triton.jit
def _to_e4m3_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, fp8.to_e4m3(x, True), mask=offs < n)


@triton.jit
def _from_e4m3_kernel(q_ptr, y_ptr):
    offs = tl.arange(0, 256)
    tl.store(y_ptr + offs, fp8.from_e4m3(tl.load(q_ptr + offs), True))


@triton.jit
def _pow2_scale_kernel(amax_ptr, s_ptr, inv_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale, inverse = fp8.pow2_scale(tl.load(amax_ptr + offs, mask=offs < n))
    tl.store(s_ptr + offs, scale, mask=offs < n)
    tl.store(inv_ptr + offs, inverse, mask=offs < n)


def _fp32_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32))


def _dense_fp32_sample() -> torch.Tensor:
    """Every fp32 within 64 ulps of each e4m3 magnitude and of each midpoint between two
    neighbours (the rounding and saturation boundaries, 464 included), a sweep of every 1021st
    pattern below 2^9 (all e4m3 values and subnormals), random patterns (NaNs, infs, huge and
    tiny values among them); both signs."""
    grid = np.arange(127, dtype=np.uint8).view(np.uint8)
    values = torch.from_numpy(grid).view(FP8).double().numpy()  # 0 .. 448
    mids = np.concatenate([(values[:-1] + values[1:]) / 2, [464.0, 480.0, 512.0]])
    anchors = np.concatenate([values, mids]).astype(np.float32).view(np.uint32).astype(np.int64)
    near = (anchors[:, None] + np.arange(-64, 65)[None, :]).reshape(-1)
    sweep = np.arange(0, 0x44000000, 1021, dtype=np.int64)
    random = np.random.default_rng(0).integers(0, 2**31, size=1 << 19, dtype=np.int64)
    specials = np.array([0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 1, 0x007FFFFF])
    magnitudes = np.concatenate([near[near >= 0], sweep, random, specials])
    return _fp32_bits(np.concatenate([magnitudes, magnitudes | 0x80000000]))


def test_emulated_e4m3_conversion_is_torchs() -> None:
    """The interpreter path of ``to_e4m3`` gives torch's byte for every sampled fp32 pattern:
    nearest even, subnormals, +-448 saturation (inf too), NaN as sign | 0x7F."""
    x = _dense_fp32_sample()
    y = torch.empty(x.numel(), dtype=FP8)
    block = 1 << 18
    _to_e4m3_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
    want = x.to(FP8).view(torch.uint8)
    bad = (y.view(torch.uint8) != want).nonzero().flatten()
    assert len(bad) == 0, (
        f"{len(bad)} of {x.numel()} differ, e.g. {x[bad[:5]].tolist()}: "
        f"{y.view(torch.uint8)[bad[:5]].tolist()} != {want[bad[:5]].tolist()}"
    )


def test_emulated_e4m3_upcast_is_exact() -> None:
    q = torch.arange(256, dtype=torch.uint8).view(FP8)
    y = torch.empty(256)
    _from_e4m3_kernel[(1,)](q, y)
    want = q.float()
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))


def test_pow2_scale() -> None:
    """The scale from the bits equals 2^ceil(log2(amax / 448)) (float64 here) at and around
    every boundary, the exponent clamped at -126; amax 0 -> 1, inf -> (inf, 0)."""
    exact = torch.tensor([448.0 * 2.0**n for n in range(-130, 121)], dtype=torch.float32)
    amax = torch.cat(
        [
            exact,
            torch.nextafter(exact, torch.tensor(INF)),
            torch.nextafter(exact, torch.tensor(0.0)),
            torch.rand(4096) * torch.exp2(torch.randint(-140, 120, (4096,)).float()),
            torch.tensor([0.0, 1e-45, 1.17e-38, 1.0, 1.75, 1.7500001, 3.4e38, INF]),
        ]
    )
    scale, inverse = torch.empty_like(amax), torch.empty_like(amax)
    _pow2_scale_kernel[(triton.cdiv(amax.numel(), 1024),)](
        amax, scale, inverse, amax.numel(), BLOCK=1024
    )
    assert torch.equal(scale, ref_scale(amax))
    finite = scale.isfinite()
    assert torch.equal(inverse[finite], (1.0 / scale[finite].double()).float())
    assert inverse[~finite].eq(0).all()
    assert (amax[finite] * inverse[finite] <= 448.0).all()


# --------------------------------------------------------------------------------- quantizers


def _awkward_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Random rows of varied magnitude with zeros, a zero row, tiny values, values at and near
    448 * 2^n, negatives, a NaN and a row with an inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=gen))
    x[torch.rand(m, k, generator=gen) < 0.05] = 0.0
    x[1] = 0.0
    x[2] = torch.randn(k, generator=gen) * 1e-37  # the scale's exponent clamps at -126
    x[3, :] = -448.0 * 2.0**-3
    x[3, 5] = 448.0 * 2.0**-3 * (1 + 2.0**-7)  # just past 448 * scale: the scale doubles
    x[4, :] = 448.0 * 2.0**5 * (1 - 2.0**-8)
    x[5, 7] = NAN
    x[6, 9] = -INF
    return x


# inf * 0 (an inf's block) is NaN on purpose
INF_BLOCK = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@INF_BLOCK
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_bitwise(dtype: torch.dtype) -> None:
    x = _awkward_rows(37, 300, seed=1).to(dtype)  # partial last 128-block
    with poisoned_buffers():
        q, scale = fp8.quantize_rows(x)
    want_q, want_scale = ref_quantize_rows(x)
    assert q.shape == (37, 300) and scale.shape == (37, 3) and scale.t().is_contiguous()
    assert same_bytes(q, want_q)
    assert torch.equal(scale, want_scale)
    # the policy, spelled out: NaN stays NaN, an inf makes its block NaN when dequantized
    assert q[5, 7].float().isnan() and q[5].float().isnan().sum() == 1
    assert scale[6, 0] == INF and dequant_rows(q, scale)[6, :128].isnan().all()
    assert dequant_rows(q, scale)[6, 128:].isfinite().all()
    assert scale[1].eq(1).all() and q[1].float().eq(0).all()
    assert (scale[3, 0], scale[4, 0]) == (2.0**-2, 2.0**5)


@INF_BLOCK
def test_quantize_cols_is_quantize_rows_of_the_transpose() -> None:
    x = _awkward_rows(37, 300, seed=2).to(torch.bfloat16).t()  # a [300, 37] strided view
    with poisoned_buffers():
        q_t, scale = fp8.quantize_cols(x)
    want_q, want_scale = ref_quantize_rows(x.t())
    assert q_t.shape == (37, 300) and scale.shape == (37, 3) and scale.t().is_contiguous()
    assert same_bytes(q_t, want_q) and torch.equal(scale, want_scale)


@INF_BLOCK
@pytest.mark.parametrize("rows, pad_to", [(37, 16), (300, 16), (256, 1), (9, 128)])
def test_quantize_rows_cols_is_both_quantizers(rows: int, pad_to: int) -> None:
    """One pass gives the bytes of quantize_rows and of quantize_cols of the zero-padded rows."""
    x = _awkward_rows(rows, 300, seed=rows).to(torch.bfloat16)
    x = torch.cat([x, x], 1)[:, 150:450]  # a strided view: rows 600 apart
    with poisoned_buffers():
        (q, scale), (q_t, scale_t) = fp8.quantize_rows_cols(x, pad_to=pad_to)
    want_q, want_scale = ref_quantize_rows(x)
    padded = torch.cat([x, x.new_zeros(-rows % pad_to, 300)])
    want_q_t, want_scale_t = ref_quantize_rows(padded.t())
    assert q_t.shape == (300, padded.shape[0]) and scale_t.shape == want_scale_t.shape
    assert same_bytes(q, want_q) and torch.equal(scale, want_scale)
    assert same_bytes(q_t, want_q_t) and torch.equal(scale_t, want_scale_t)
    assert scale.t().is_contiguous() and scale_t.t().is_contiguous()
    assert q_t[:, rows:].float().eq(0).all()  # the padding rows' columns
    with pytest.raises(ValueError, match="pad_to must be a positive int, got 0"):
        fp8.quantize_rows_cols(x, pad_to=0)
    if padded.shape[0] % 16 == 0:  # the 128x1 part into packed rows of x'^T
        width = fp8.packed_width(padded.shape[0])
        packed = torch.full((300, width), -1, dtype=torch.int16)
        with poisoned_buffers():
            (q2, scale2), (q_t2, scale_t2) = fp8.quantize_rows_cols(x, pad_to, cols_out=packed)
        assert same_bytes(q2, q) and torch.equal(scale2, scale)
        assert same_bytes(q_t2, q_t) and torch.equal(scale_t2, scale_t)
        assert torch.equal(packed, fp8.pack_rows(q_t, scale_t))  # the tail words zero too
        assert q_t2.data_ptr() == packed.data_ptr()  # views of cols_out
        with pytest.raises(ValueError, match=rf"cols_out must be an int16 \[300, {width}\]"):
            fp8.quantize_rows_cols(x, pad_to, cols_out=packed[:, :-16])


def test_quantize_weight_and_its_transpose() -> None:
    gen = torch.Generator().manual_seed(3)
    stacked = (torch.randn(3, 400, 300, generator=gen) * 0.02).to(torch.bfloat16)
    stacked[1, 210:220, 5] = 0.0
    stacked[2, :128, :128] = 0.0  # a zero block: scale 1
    w = stacked[:, 200:]  # one half of a stacked weight, read in place: [3, 200, 300]
    with poisoned_buffers():
        qw = fp8.quantize_weight(w, transposed=True)
        plain = fp8.quantize_weight(w)
        only_t = fp8.quantize_weight(w, transposed=True, plain=False)
    want_q, want_scale = ref_quantize_weight(w)
    assert qw.q.shape == (3, 200, 300) and qw.scale.shape == (3, 2, 3)
    assert same_bytes(qw.q, want_q) and torch.equal(qw.scale, want_scale)
    assert same_bytes(qw.q_t, want_q.transpose(1, 2).contiguous())
    assert torch.equal(qw.scale_t, want_scale.transpose(1, 2))
    assert plain.q_t is None and same_bytes(plain.q, qw.q) and torch.equal(plain.scale, qw.scale)
    assert only_t.q is None and only_t.scale is None
    assert same_bytes(only_t.q_t, qw.q_t) and torch.equal(only_t.scale_t, qw.scale_t)


def test_quantizers_name_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"x must be a 2-D bf16/fp16/fp32 tensor, got .*\[4\]"):
        fp8.quantize_rows(torch.zeros(4))
    with pytest.raises(ValueError, match="w must be a 3-D"):
        fp8.quantize_weight(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="plain=False .* transposed must be True"):
        fp8.quantize_weight(torch.zeros(1, 4, 4), plain=False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.quantize_cols(torch.zeros(4, 4, dtype=FP8))


# ------------------------------------------------------------------ packed rows, re-blocking


def test_packed_width() -> None:
    # H bytes + 4 bytes per 128 columns, in int16 words, padded to PACK_WORDS
    assert fp8.packed_width(7168) == 3584 + 112  # dsv3: already a multiple of 16 words
    assert fp8.packed_width(144) == 80 and fp8.packed_width(16) == 16
    for h in range(16, 4096, 16):
        width = fp8.packed_width(h)
        assert width % fp8.PACK_WORDS == 0 and h // 2 + 2 * triton.cdiv(h, 128) <= width <= h
    for bad in (0, 8, 136, 7168.0, True):
        with pytest.raises(ValueError, match=r"hidden must be a positive multiple of 16"):
            fp8.packed_width(bad)


def test_pack_unpack_round_trip_is_exact() -> None:
    """Every fp8 byte (NaN included) and every float32 scale bit pattern (inf, NaN, subnormal,
    negative zero) comes back unchanged; the padding words are zeros."""
    m, h = 300, 272  # a partial 128-block: 3 scales, 136 + 6 = 142 words padded to 144
    gen = torch.Generator().manual_seed(4)
    q = torch.arange(m * h, dtype=torch.int64).remainder(256).to(torch.uint8).view(m, h).view(FP8)
    bits = torch.randint(-(2**31), 2**31, (m, 3), generator=gen, dtype=torch.int64)
    bits[:4, 0] = torch.tensor([0x7F800000, 0x7FC00001, 0x00000001, -(2**31)])
    scale = bits.to(torch.int32).view(torch.float32)
    with poisoned_buffers():
        packed = fp8.pack_rows(q, scale)
    assert packed.dtype == torch.int16 and packed.shape == (m, fp8.packed_width(h)) == (m, 144)
    q2, scale2 = fp8.unpack_rows(packed, h)
    assert same_bytes(q2, q) and torch.equal(scale2.view(torch.int32), scale.view(torch.int32))
    assert q2.data_ptr() == packed.data_ptr()  # views, no copy
    assert packed.view(torch.uint8)[:, h + 12 :].eq(0).all()
    # a strided scale (quantize_rows' MN-major view) packs the same
    mn_major = scale.t().contiguous().t()
    assert torch.equal(fp8.pack_rows(q, mn_major), packed)


@INF_BLOCK
def test_quantize_packed_is_pack_rows_of_quantize_rows() -> None:
    x = _awkward_rows(37, 272, seed=5).to(torch.bfloat16)
    with poisoned_buffers():
        packed = fp8.quantize_packed(x)
        into = torch.full((37, fp8.packed_width(272)), -1, dtype=torch.int16)
        fp8.quantize_packed(x, out=into)
        want = fp8.pack_rows(*fp8.quantize_rows(x))
    assert torch.equal(packed, want) and torch.equal(into, want)
    q, scale = fp8.unpack_rows(packed, 272)
    want_q, want_scale = ref_quantize_rows(x)
    assert same_bytes(q, want_q) and torch.equal(scale, want_scale)


@INF_BLOCK
def test_requantize_cols_is_quantize_cols_of_the_dequantized_rows() -> None:
    """Bit for bit, from the packed views too; on unscaled Gaussian rows it also equals the
    direct 128x1 quantization of x on all but a few elements (only values in an E4M3 subnormal
    range of a block can differ)."""
    x = _awkward_rows(300, 272, seed=6)  # 3 column blocks, the last partial; tiny rows
    q, scale = fp8.quantize_rows(x)
    with poisoned_buffers():
        q_t, s_t = fp8.requantize_cols(q, scale)
        from_packed = fp8.requantize_cols(*fp8.unpack_rows(fp8.pack_rows(q, scale), 272))
    values = fp8.dequantize_rows(q, scale)
    assert torch.allclose(values.double(), dequant_rows(q, scale), 0, 0, equal_nan=True)
    want_q, want_s = fp8.quantize_cols(values)
    assert same_bytes(q_t, want_q) and torch.equal(s_t, want_s)
    assert same_bytes(from_packed[0], want_q) and torch.equal(from_packed[1], want_s)
    # re-blocking an E4M3 value times a power of two is exact above the subnormal range
    back = dequant_rows(q_t, s_t)
    finite = values.t().isfinite()
    tiny = values.t().abs() < s_t.double().repeat_interleave(128, 1)[:, :300] * 2.0**-6
    assert torch.equal(back[finite & ~tiny], values.t().double()[finite & ~tiny])
    gauss = torch.randn(512, 1024, generator=torch.Generator().manual_seed(7))
    direct = dequant_rows(*fp8.quantize_cols(gauss))
    reblocked = dequant_rows(*fp8.requantize_cols(*fp8.quantize_rows(gauss)))
    assert (direct != reblocked).double().mean() < 1e-4


def test_passes_over_a_row_layout_read_and_write_only_its_used_rows() -> None:
    """Given ``UsedRows``, ``quantize_rows_cols`` (two stacked layouts in one pass, as the
    SwiGLU backward's d_g and d_u) and ``requantize_cols`` write, on the used rows, the bits
    of the unbounded passes over those rows alone, and leave every 128-row block past them
    unwritten (poison) and unread (inf there would zero the used blocks' scales or warn in
    the interpreter); a bad bound is named."""
    m, n, used_blocks = 512, 272, 2
    used = used_blocks * 128
    num_blocks = torch.tensor([used_blocks], dtype=torch.int32)
    gen = torch.Generator().manual_seed(21)
    both = torch.randn(2, m, n, generator=gen).to(torch.bfloat16)
    both[:, used:] = float("inf")  # (a capacity buffer's unwritten rows)
    bound = fp8.UsedRows(num_blocks, 128, m)
    with poisoned_buffers():
        (q, s), (q_t, s_t) = fp8.quantize_rows_cols(both.view(2 * m, n), used=bound)
        packed = fp8.pack_rows(*fp8.quantize_rows(both[0, :used]))
        packed = torch.cat([packed, packed.new_full((m - used, packed.shape[1]), 0x7F7F)])
        rq_t, rs_t = fp8.requantize_cols(*fp8.unpack_rows(packed, n), used=bound)
    want_rq, want_rs = fp8.requantize_cols(*fp8.quantize_rows(both[0, :used]))
    assert same_bytes(rq_t[:, :used], want_rq) and torch.equal(rs_t[:, :used_blocks], want_rs)
    assert rq_t[:, used:].view(torch.uint8).eq(0x7F).all() and rs_t[:, used_blocks:].isnan().all()
    for half in range(2):
        rows = slice(half * m, half * m + used)
        (wq, ws), (wq_t, ws_t) = fp8.quantize_rows_cols(both[half, :used])
        assert same_bytes(q[rows], wq) and torch.equal(s[rows], ws)
        blocks = slice(half * m // 128, half * m // 128 + used_blocks)
        assert same_bytes(q_t[:, rows], wq_t) and torch.equal(s_t[:, blocks], ws_t)
        past = slice(half * m + used, (half + 1) * m)
        assert q[past].view(torch.uint8).eq(0x7F).all() and s[past].isnan().all()
        assert q_t[:, past].view(torch.uint8).eq(0x7F).all()
        past_blocks = slice(blocks.stop, (half + 1) * m // 128)
        assert s_t[:, past_blocks].isnan().all()
    x = both[0]
    for bad, match in [
        (fp8.UsedRows(num_blocks.long(), 128, m), "used.num_blocks must be a one-element int32"),
        (fp8.UsedRows(num_blocks, 64, m), "used.block_rows must be a multiple of 128"),
        (fp8.UsedRows(num_blocks, 128, 384), "used.period must be a multiple of 128 that"),
        ((num_blocks, 128, m), "used must be a UsedRows"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            fp8.quantize_rows_cols(x, used=bad)


def test_route_grad_reads_packed_dy_rows() -> None:
    """The route grad on packed fp8 rows of dy (by token and, pulled, by row): dz = w * dy and
    dw = <dy, z> of the dequantized dy, against float64 (dz within its bf16 rounding, dw
    within fp32 summation), and bitwise the kernel's result on that dy given as fp32 (the same
    reduction); every used row written, the two layouts' bits equal."""
    from megamoe.kernels import rows

    t, k, e, h = 21, 2, 3, 272  # H 272: a partial 128 block of scales
    gen = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    sched = build_row_schedule(ids, e, 16)
    dy = (torch.randn(t, h, generator=gen) * torch.rand(t, 1, generator=gen) * 8).to(torch.bfloat16)
    w = torch.rand(t, k, generator=gen)
    z = torch.randn(sched.rows, h, generator=gen).to(torch.bfloat16)
    packed = fp8.quantize_packed(dy)
    dq = fp8.dequantize_rows(*fp8.unpack_rows(packed, h))  # exact fp32
    assert not torch.equal(dq, dy.float())  # (quantized: the route grad sees other values)
    with poisoned_buffers():
        dz, dw = rows.route_grad(packed, z, w, sched)
        dz_rows, dw_rows = rows.route_grad_rows(rows.gather(packed, sched), z, w, sched)
    dz_f32, dw_f32 = rows.route_grad(dq, z, w, sched)
    used = int(sched.num_blocks) * 16
    slots = sched.row_src[:used].long()
    real = slots >= 0
    assert torch.equal(dz[:used], dz_f32[:used]) and torch.equal(dw, dw_f32)
    assert torch.equal(dz_rows[:used], dz[:used])
    assert torch.equal(dw_rows[:used][real], dw.view(-1)[slots[real]])
    assert (dz[:used][~real] == 0).all()  # padding rows zeros
    tok = slots[real] // k
    want_dz = w.view(-1)[slots[real]].double()[:, None] * dq[tok].double()
    err = (dz[:used][real].double() - want_dz).abs()
    assert (err <= 2.0**-8 * want_dz.abs()).all()  # half a bf16 ulp
    prods = dq[tok].double() * z[:used][real].double()
    dw_err = (dw.view(-1)[slots[real]].double() - prods.sum(1)).abs()
    assert (dw_err <= 1e-6 * prods.abs().sum(1)).all()


@pytest.mark.parametrize("h, chunk", [(384, 128), (272, 128), (272, 64)])
def test_route_grad_quantizes_dz(monkeypatch, h: int, chunk: int) -> None:
    """``route_grad(..., quantize=True)`` (the fp8 backward's): d_z's two quantizations are
    bitwise ``quantize_rows_cols`` of the bf16 d_z the plain route grad writes, by token and
    (pulled) by row, every used row's bytes and scales written (poisoned buffers), in one pass
    over each tile and in two sweeps of 64 (H 272: a partial 128-column block); dw matches
    float64 within fp32 summation and is the same by token and by row; bad arguments are
    named."""
    from megamoe.kernels import rows

    monkeypatch.setattr(rows, "_QUANT_CHUNK", chunk)

    t, k, e = 150, 2, 3  # 300 rows in 128-row blocks: padding rows in every expert's last one
    gen = torch.Generator().manual_seed(12)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    sched = build_row_schedule(ids, e, 128)
    dy = (torch.randn(t, h, generator=gen) * torch.rand(t, 1, generator=gen) * 8).to(torch.bfloat16)
    dy[3, 5] = float("nan")  # (a NaN stays in its blocks, in both paths alike)
    w = torch.rand(t, k, generator=gen)
    z = torch.randn(sched.rows, h, generator=gen).to(torch.bfloat16)
    packed = fp8.quantize_packed(dy)
    dz, dw_plain = rows.route_grad(packed, z, w, sched)
    with poisoned_buffers():
        want = fp8.quantize_rows_cols(dz, used=fp8.UsedRows(sched.num_blocks, 128, sched.rows))
        got, dw = rows.route_grad(packed, z, w, sched, quantize=True)
        got_rows, dw_rows = rows.route_grad_rows(
            rows.gather(packed, sched), z, w, sched, quantize=True
        )
    used = int(sched.num_blocks) * 128
    blocks = used // 128
    for q in (got, got_rows):
        (qr, sr), (qc, sc) = q
        (wr, wsr), (wc, wsc) = want
        assert torch.equal(qr[:used].view(torch.uint8), wr[:used].view(torch.uint8))
        assert torch.equal(sr[:used], wsr[:used])
        assert torch.equal(qc[:, :used].view(torch.uint8), wc[:, :used].view(torch.uint8))
        assert torch.equal(sc[:, :blocks], wsc[:, :blocks])
    slots = sched.row_src[:used].long()
    real = slots >= 0
    bits = dw_rows[:used][real].view(torch.int32)
    assert torch.equal(bits, dw.view(-1)[slots[real]].view(torch.int32))
    finite = ~torch.isnan(dw_plain.view(-1)[slots[real]])
    assert torch.equal(torch.isnan(dw.view(-1)[slots[real]]), ~finite)
    dq = fp8.dequantize_rows(*fp8.unpack_rows(packed, h))
    prods = dq[slots[real] // k].double() * z[:used][real].double()
    err = (dw.view(-1)[slots[real]].double() - prods.sum(1)).abs()
    assert (err[finite] <= 1e-6 * prods.abs().sum(1)[finite]).all()
    with pytest.raises(ValueError, match="dz: route_grad"):
        rows.route_grad(packed, z, w, sched, dz=dz, quantize=True)
    small = build_row_schedule(ids, e, 16)
    z16 = torch.zeros(small.rows, h, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_rows = 16"):
        rows.route_grad(packed, z16, w, small, quantize=True)


def test_packed_rows_name_bad_arguments() -> None:
    q, scale = fp8.quantize_rows(torch.randn(4, 144))
    with pytest.raises(ValueError, match=r"packed must be an int16 \[rows, 80\] tensor"):
        fp8.unpack_rows(torch.zeros(4, 72, dtype=torch.int16), 144)
    with pytest.raises(ValueError, match=r"out must be an int16 \[4, 80\] tensor"):
        fp8.pack_rows(q, scale, out=torch.zeros(4, 80, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"scale must be a float32 \[4, 2\] tensor"):
        fp8.requantize_cols(q, scale[:, :1])
    with pytest.raises(ValueError, match="q must be a 2-D float8_e4m3fn tensor"):
        fp8.dequantize_rows(q.float(), scale)


# -------------------------------------------------------------------------------------- GEMMs


class Problem(NamedTuple):
    sched: RowSchedule
    used: int
    row_expert: torch.Tensor  # [used] expert of each used row
    x: torch.Tensor  # [rows, H] bf16; padding rows hold zeros, as the layer's do
    dz: torch.Tensor  # [rows, H] bf16
    w_gate: fp8.Fp8Weight
    w_up: fp8.Fp8Weight
    w_down: fp8.Fp8Weight


# H = 272: two full K blocks and a partial one, not a multiple of the output tile.
# I = 112: one partial weight block, not a multiple of the tile. Expert 2 gets no rows.
H, I, E = 272, 112, 4


def make_problem(block_rows: int, seed: int) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    tokens, top_k = 29, 2
    experts = torch.tensor([0, 1, 3])
    ids = torch.stack([experts[torch.randperm(3, generator=gen)[:top_k]] for _ in range(tokens)])
    sched = build_row_schedule(ids, E, block_rows)
    used = int(sched.num_blocks.item()) * block_rows
    row_expert = sched.block_expert[: used // block_rows].long().repeat_interleave(block_rows)
    real = torch.zeros(sched.rows, 1)
    real[:used] = (sched.row_src[:used] >= 0).float()[:, None]

    def rows_of(width: int) -> torch.Tensor:
        return (torch.randn(sched.rows, width, generator=gen) * real).to(torch.bfloat16)

    def weight(n: int, k: int) -> fp8.Fp8Weight:
        w = torch.randn(E, n, k, generator=gen) * torch.exp2(torch.randint(-8, -3, (E, 1, 1)))
        return fp8.quantize_weight(w.to(torch.bfloat16), transposed=True)

    return Problem(
        sched, used, row_expert, rows_of(H), rows_of(H), weight(I, H), weight(I, H), weight(H, I)
    )


def by_expert(a: torch.Tensor, w: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
    """out[r] = a[r] @ w[e(r)]^T in float64 (a [used, K], w [E, N, K] float64)."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        rows = row_expert == e
        out[rows] = a[rows] @ w[e].T
    return out


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``out`` against the float64 ``ref``: every element written; norm-wise within 1e-3 of
    ``ref`` rounded to ``out``'s dtype; and as close as exact 128-deep block sums make it (the
    interpreter's are exact, so only fp32 roundings separate the kernel from float64): fp32
    outputs within 1e-6 norm-wise, bf16 outputs equal to ``ref`` rounded but for 0.1% of the
    elements, each within half a unit of the last place plus fp32 slack."""
    o = out.double()
    assert not o.isnan().any(), f"{what}: NaN (unwritten) elements"
    rounded = ref.to(out.dtype).double()
    err = (o - rounded).norm() / ref.norm()
    assert err <= 1e-3, f"{what}: relative error {err:.3g}"
    if out.dtype == torch.float32:
        err = (o - ref).norm() / ref.norm()
        assert err <= 1e-6, f"{what}: relative error {err:.3g} from float64"
    else:
        differ = (o != rounded).double().mean()
        assert differ <= 1e-3, f"{what}: {differ:.3%} of the elements differ from float64"
    half_ulp = 2.0 ** -(MANTISSA_BITS[out.dtype] + 1)
    slack = (o - ref).abs() - half_ulp * 1.01 * ref.abs()
    assert slack.max() <= 1e-6 * ref.abs().max(), f"{what}: off by {slack.max():.3g}"


def used_part(p: Problem, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[: p.used] if v.shape[0] == p.sched.rows else v for k, v in out.items()}


def training_step(p: Problem, out_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The fp8 GEMMs of one training step, each fed by the kernels' quantization of the one
    before (as the layer will run them)."""
    s, dt = p.sched, dict(out_dtype=out_dtype)
    with poisoned_buffers():
        g, u, h = fp8_gemm.gate_up(*fp8.quantize_rows(p.x), p.w_gate, p.w_up, s, **dt)
        z = fp8_gemm.grouped_mm(*fp8.quantize_rows(h), p.w_down, s, **dt)
        dg, du = fp8_gemm.dgrad_swiglu(*fp8.quantize_rows(p.dz), p.w_down, g, u, s, **dt)
        dgq, duq = fp8.quantize_rows(dg), fp8.quantize_rows(du)
        dx = fp8_gemm.dgrad_pair(*dgq, p.w_gate, *duq, p.w_up, s, **dt)
        out = dict(g=g, u=u, h=h, z=z, dg=dg, du=du, dx=dx)
        if s.block_rows % 128 == 0:
            dgt, xt = fp8.quantize_cols(dg), fp8.quantize_cols(p.x)
            out["dw_gate"] = fp8_gemm.wgrad(*dgt, *xt, s, **dt)
    return used_part(p, out)


@pytest.mark.parametrize(
    "block_rows, out_dtype", [(16, torch.bfloat16), (16, torch.float32), (128, torch.bfloat16)]
)
def test_gemms_match_float64_of_the_quantized_operands(
    block_rows: int, out_dtype: torch.dtype
) -> None:
    p = make_problem(block_rows, seed=block_rows)
    out = training_step(p, out_dtype)
    used, re = p.used, p.row_expert

    def a_of(x: torch.Tensor) -> torch.Tensor:
        return dequant_rows(*fp8.quantize_rows(x[:used]))

    def w_of(w: fp8.Fp8Weight, transposed: bool = False) -> torch.Tensor:
        return dequant_weight(w.q_t, w.scale_t) if transposed else dequant_weight(w.q, w.scale)

    x = a_of(p.x)
    g, u = by_expert(x, w_of(p.w_gate), re), by_expert(x, w_of(p.w_up), re)
    assert_matches(out["g"], g, "g")
    assert_matches(out["u"], u, "u")
    assert_matches(out["h"], torch.nn.functional.silu(g) * u, "h")
    assert_matches(out["z"], by_expert(a_of(out["h"]), w_of(p.w_down), re), "z")
    dh = by_expert(a_of(p.dz), w_of(p.w_down, True), re)
    gb, ub = out["g"].double(), out["u"].double()
    sig = torch.sigmoid(gb)
    assert_matches(out["dg"], dh * ub * (sig + gb * sig * (1 - sig)), "dg")
    assert_matches(out["du"], dh * gb * sig, "du")
    dx = by_expert(a_of(out["dg"]), w_of(p.w_gate, True), re) + by_expert(
        a_of(out["du"]), w_of(p.w_up, True), re
    )
    assert_matches(out["dx"], dx, "dx")
    if block_rows % 128 == 0:
        dg_t = dequant_rows(*fp8.quantize_cols(out["dg"]))  # [I, used]
        x_t = dequant_rows(*fp8.quantize_cols(p.x[:used]))  # [H, used]
        start = p.sched.row_start.tolist()
        dw = torch.stack(
            [dg_t[:, start[e] : start[e + 1]] @ x_t[:, start[e] : start[e + 1]].T for e in range(E)]
        )
        assert out["dw_gate"][2].eq(0).all()  # the expert with no rows: zeros, written
        assert_matches(out["dw_gate"], dw, "dw_gate")
        with poisoned_buffers():
            dw32 = fp8_gemm.wgrad(
                *fp8.quantize_cols(out["dg"]),
                *fp8.quantize_cols(p.x[:used]),
                p.sched,
                out_dtype=torch.float32,
            )
        assert_matches(dw32, dw, "dw_gate (fp32)")


def test_bits_repeat_and_do_not_depend_on_grid_tile_width_or_scale_layout(monkeypatch) -> None:
    """Every GEMM, run to run, for every grid, output tile width (16 to 256: the weight scales
    as one scalar or one per column; the weight gradient's tile height too), row tile height
    (a 128-row block in two tiles), a row tile as two halves (``split_m``), programs per SM
    and activation scale layout (MN-major or row-major)."""
    p = make_problem(128, seed=5)
    s = p.sched
    gen = torch.Generator().manual_seed(8)
    xq, hq, dzq, dgq, duq = (
        fp8.quantize_rows(torch.randn(s.rows, n, generator=gen)) for n in (H, I, H, I, I)
    )
    dgt, xt = fp8.quantize_cols(p.x[:, :I]), fp8.quantize_cols(p.x)

    def every_gemm(**kw) -> dict[str, torch.Tensor]:
        with poisoned_buffers():
            g, u, h = fp8_gemm.gate_up(*xq, p.w_gate, p.w_up, s, **kw)
            dg, du = fp8_gemm.dgrad_swiglu(*dzq, p.w_down, g, u, s, **kw)
            out = dict(
                g=g,
                u=u,
                h=h,
                z=fp8_gemm.grouped_mm(*hq, p.w_down, s, **kw),
                dg=dg,
                du=du,
                dx=fp8_gemm.dgrad_pair(*dgq, p.w_gate, *duq, p.w_up, s, **kw),
                dw=fp8_gemm.wgrad(*dgt, *xt, s, **kw),
            )
        return used_part(p, out)

    want = every_gemm()
    for what, kw in (("a repeat", {}), ("1 program", dict(programs=1))):
        for name, got in every_gemm(**kw).items():
            assert torch.equal(got, want[name]), f"{name} changed: {what}"
    for bn, bm, row_bm, per_sm, split in (
        (16, 16, 0, 1, 1),
        (256, 64, 0, 1, 1),
        (32, 32, 64, 2, 1),
        (32, 32, 0, 2, 2),  # every GEMM's tiles as two halves (fp8_half_mma)
        (16, 32, 32, 1, 2),
        (32, 32, 0, 1, 1),  # every GEMM unsplit
    ):
        tiles = {
            kind: dataclasses.replace(
                t,
                bn=bn,
                bm=bm if kind.startswith("wgrad") else row_bm,
                programs_per_sm=per_sm,
                split_m=split,
            )
            for kind, t in fp8_gemm.INTERPRETER_TILES.items()
        }
        monkeypatch.setattr(fp8_gemm, "INTERPRETER_TILES", tiles)
        for name, got in every_gemm().items():
            assert not got.isnan().any(), f"{name}: a tile was not written ({bn} x {bm})"
            assert torch.equal(got, want[name]), f"{name} changed with tiles {bn} x {bm}"
    monkeypatch.undo()
    with poisoned_buffers():
        g = fp8_gemm.gate_up(xq[0], xq[1].contiguous(), p.w_gate, p.w_up, s)[0]
    assert torch.equal(g[: p.used], want["g"])


def test_flattened_loops_have_the_tile_loops_bits(monkeypatch) -> None:
    """``GemmTiles.flatten`` runs each program's tiles as one loop over all of their K steps
    (gate/up, the grouped mm, the SwiGLU backward, the weight gradient): the same sums in the same
    order, for any grid (one program: every tile in one loop), split or not, every element
    written, and the weight gradient of expert 2 (no rows) zero."""
    p = make_problem(128, seed=9)
    s = p.sched
    assert int(s.counts[2]) == 0
    gen = torch.Generator().manual_seed(10)
    xq, hq, dzq = (fp8.quantize_rows(torch.randn(s.rows, n, generator=gen)) for n in (H, I, H))
    dgt, xt = fp8.quantize_cols(p.x[:, :I]), fp8.quantize_cols(p.x)
    g, u = p.x[:, :I].contiguous(), p.x[:, I : 2 * I].contiguous()

    def gemms(programs=None) -> dict[str, torch.Tensor]:
        with poisoned_buffers():
            out = dict(
                gu=torch.stack(fp8_gemm.gate_up(*xq, p.w_gate, p.w_up, s, programs)),
                z=fp8_gemm.grouped_mm(*hq, p.w_down, s, programs),
                dgdu=torch.stack(fp8_gemm.dgrad_swiglu(*dzq, p.w_down, g, u, s, programs)),
                dw=fp8_gemm.wgrad(*dgt, *xt, s, programs),
            )
        return {
            k: v[:, : p.used] if v.dim() == 3 and k != "dw" else v
            for k, v in used_part(p, out).items()
        }

    want = gemms()
    assert torch.equal(want["dw"][2], torch.zeros_like(want["dw"][2]))
    base = dict(fp8_gemm.INTERPRETER_TILES)  # (the tile loops: ``flatten`` off)
    # (the third: two row tiles a 128-row block, so the walks look the expert up by block)
    for bn, bm, row_bm, split in ((32, 32, 0, 2), (16, 16, 0, 1), (32, 32, 64, 1)):
        tiles = {
            kind: dataclasses.replace(
                t, bn=bn, bm=bm if kind.startswith("wgrad") else row_bm, split_m=split
            )
            for kind, t in base.items()
        }
        monkeypatch.setattr(fp8_gemm, "INTERPRETER_TILES", tiles)
        tile_loops = gemms()
        for kind in ("gate_up", "mm", "swiglu_bwd", "wgrad"):
            tiles[kind] = dataclasses.replace(tiles[kind], flatten=True)
        for programs in (None, 1):
            what = f"{bn} x {bm} (rows {row_bm}), split {split}, {programs} programs"
            for name, got in gemms(programs).items():
                assert not got.isnan().any(), f"{name}: a tile was not written ({what})"
                assert torch.equal(got, tile_loops[name]), (
                    f"{name}: flattening changed bits ({what})"
                )
                assert torch.equal(got, want[name]), f"{name}: tiles changed bits ({what})"


def test_flattened_weight_gradient_walks_experts_of_unequal_steps(monkeypatch) -> None:
    """The flattened weight gradient's two walks (``tiles.next_tile_rows``, ``tile_steps``)
    over experts of 3, 1, 0 (one step of zeros) and 2 K steps: the tile loop's bits, for one
    program (every tile in one loop), three and the default grid, every element written."""
    counts = {0: 300, 1: 40, 3: 150}  # rows per expert: K steps 3, 1, (expert 2: none), 2
    ids = torch.cat([torch.full((n,), e) for e, n in counts.items()])[:, None]
    sched = build_row_schedule(ids, E, 128)
    gen = torch.Generator().manual_seed(12)
    real = (sched.row_src >= 0)[:, None]
    a, b = (torch.randn(sched.rows, n, generator=gen) * real for n in (96, 64))
    operands = (*fp8.quantize_cols(a.to(torch.bfloat16)), *fp8.quantize_cols(b.to(torch.bfloat16)))
    with poisoned_buffers():
        want = fp8_gemm.wgrad(*operands, sched)
    assert torch.equal(want[2], torch.zeros_like(want[2]))
    tiles = dict(fp8_gemm.INTERPRETER_TILES)
    tiles["wgrad"] = dataclasses.replace(tiles["wgrad"], flatten=True)
    monkeypatch.setattr(fp8_gemm, "INTERPRETER_TILES", tiles)
    for programs in (None, 1, 3):
        with poisoned_buffers():
            got = fp8_gemm.wgrad(*operands, sched, programs)
        assert not got.isnan().any(), f"a tile was not written ({programs} programs)"
        assert torch.equal(got, want), f"flattening changed bits ({programs} programs)"


def test_nan_rows_stay_nan() -> None:
    """A NaN in one activation row makes that row's outputs NaN and no other's."""
    p = make_problem(16, seed=6)
    x = p.x.clone()
    row = int((p.sched.row_src[: p.used] >= 0).nonzero()[3])
    x[row, 100] = NAN
    with poisoned_buffers():
        g = fp8_gemm.gate_up(*fp8.quantize_rows(x), p.w_gate, p.w_up, p.sched)[0][: p.used]
    assert g[row].isnan().all()
    assert not g[torch.arange(p.used) != row].isnan().any()


def test_gemms_name_bad_arguments() -> None:
    p = make_problem(16, seed=7)
    s = p.sched
    xq, xs = fp8.quantize_rows(p.x)
    with pytest.raises(ValueError, match=r"a must be a float8_e4m3fn \[rows, K\] tensor"):
        fp8_gemm.grouped_mm(p.x, xs, p.w_up, s)
    with pytest.raises(ValueError, match=r"a has K = 200 columns; .* K % 16 == 0"):
        fp8_gemm.grouped_mm(*fp8.quantize_rows(p.x[:, :200]), p.w_up, s)
    with pytest.raises(ValueError, match=r"a_scale must be a float32 \[128, 3\] tensor"):
        fp8_gemm.grouped_mm(xq, xs[:, :2], p.w_up, s)
    with pytest.raises(ValueError, match=r"w.q must be a float8_e4m3fn \[4, N, 272\] tensor"):
        fp8_gemm.grouped_mm(xq, xs, p.w_down, s)
    odd = fp8.quantize_weight(torch.zeros(E, 100, H))
    with pytest.raises(ValueError, match=r"w.q has N = 100 rows per expert; .* N % 8 == 0"):
        fp8_gemm.grouped_mm(xq, xs, odd, s)
    with pytest.raises(ValueError, match="w_down has no transposed copy"):
        fp8_gemm.dgrad_swiglu(xq, xs, p.w_down._replace(q_t=None), p.x, p.x, s)
    g = p.x[:, :I].contiguous()
    both = torch.empty(2, s.rows, I, dtype=torch.bfloat16)
    dg, du = fp8_gemm.dgrad_swiglu(xq, xs, p.w_down, g, g, s, out=both)
    assert dg.data_ptr() == both.data_ptr() and du.data_ptr() == both[1].data_ptr()
    want = fp8_gemm.dgrad_swiglu(xq, xs, p.w_down, g, g, s)
    assert all(torch.equal(a[: p.used], b[: p.used]) for a, b in zip((dg, du), want))
    with pytest.raises(ValueError, match=r"out must be a contiguous floating \[2, 128, 112\]"):
        fp8_gemm.dgrad_swiglu(xq, xs, p.w_down, g, g, s, out=both[:, :, :100])
    with pytest.raises(ValueError, match=r"w_gate.scale must be a float32 \[4, 1, 3\]"):
        fp8_gemm.gate_up(xq, xs, p.w_gate._replace(scale=p.w_gate.scale[:, :, :2]), p.w_up, s)
    with pytest.raises(ValueError, match=r"sched.block_rows is 16; .* multiple of 128"):
        fp8_gemm.wgrad(*fp8.quantize_cols(p.x), *fp8.quantize_cols(p.x), s)
    s128 = make_problem(128, seed=7).sched
    with pytest.raises(ValueError, match=r"b_t has N = 100 rows; .* N % 8 == 0"):
        fp8_gemm.wgrad(*fp8.quantize_cols(p.x[:, :128]), *fp8.quantize_cols(p.x[:, :100]), s128)
    with pytest.raises(ValueError, match="programs must be >= 1, got 0"):
        fp8_gemm.grouped_mm(xq, xs, p.w_up, s, programs=0)
    for split in (3, 4):  # 3 is not a split; 16 rows do not halve into 8-row multiples of 2
        tiles = dict(fp8_gemm.INTERPRETER_TILES)
        tiles["mm"] = dataclasses.replace(tiles["mm"], split_m=split)
        with mock.patch.object(fp8_gemm, "INTERPRETER_TILES", tiles):
            with pytest.raises(
                ValueError, match=rf"tiles\['mm'\].split_m = {split} must be 1 or 2"
            ):
                fp8_gemm.grouped_mm(xq, xs, p.w_up, s)
    tiles = dict(fp8_gemm.INTERPRETER_TILES)
    tiles["wgrad"] = dataclasses.replace(tiles["wgrad"], bm=8, split_m=2)  # 4-row halves
    with mock.patch.object(fp8_gemm, "INTERPRETER_TILES", tiles):
        with pytest.raises(ValueError, match=r"tiles\['wgrad'\].split_m = 2 must be 1 or 2"):
            fp8_gemm.wgrad(*fp8.quantize_cols(p.x[:, :128]), *fp8.quantize_cols(p.x), s128)
    assert math.isclose(fp8.E4M3_MAX, torch.finfo(FP8).max)


@pytest.mark.parametrize("rows", [None, 200])
def test_dgrad_swiglu_quantized_is_the_pass_over_dgrad_swiglu(rows: int | None) -> None:
    """``fp8_gemm.dgrad_swiglu_quantized`` (the layer's backward), which off Hopper runs
    ``dgrad_swiglu`` and one pass for both outputs where no 128-row block straddles them (the
    routed rows, 128-row blocks) or one each (200 rows of one expert, the shared expert's
    layout): bitwise ``quantize_rows_cols(x, pad_to=16)`` of each of d_g and d_u on the used
    rows, on poisoned buffers. (On Hopper its epilogue quantizes them: ``tests/gpu/
    test_fp8.py`` compares the two.)"""
    p = make_problem(128, seed=11)
    s, w_down, used = p.sched, p.w_down, p.used
    gen = torch.Generator().manual_seed(5)
    dz = p.dz
    if rows is not None:
        s, used = uniform_schedule(rows, 128, "cpu"), rows
        dz = torch.randn(rows, H, generator=gen).to(torch.bfloat16)
        w_down = fp8.Fp8Weight(*(t[:1] for t in w_down))
    assert (dz.shape[0] % 128 == 0) == (rows is None)  # both of the pass's ways
    dzq = fp8.quantize_rows(dz)
    g, u = (torch.randn(dz.shape[0], I, generator=gen).to(torch.bfloat16) for _ in range(2))
    with poisoned_buffers():
        got = fp8_gemm.dgrad_swiglu_quantized(*dzq, w_down, g, u, s)
        want = [fp8.quantize_rows_cols(x, pad_to=16)
                for x in fp8_gemm.dgrad_swiglu(*dzq, w_down, g, u, s)]  # fmt: skip
    for name, ((q, sc), (q_t, sc_t)), ((wq, ws), (wq_t, ws_t)) in zip(("dg", "du"), got, want):
        assert torch.equal(q[:used].view(torch.uint8), wq[:used].view(torch.uint8)), name
        assert torch.equal(sc[:used], ws[:used]), f"{name}: 1x128 scales"
        assert torch.equal(q_t.view(torch.uint8)[:, :used], wq_t.view(torch.uint8)[:, :used])
        blocks = triton.cdiv(used, 128)
        assert torch.equal(sc_t[:, :blocks], ws_t[:, :blocks]), f"{name}: 128x1 scales"
        assert sc[:used].isfinite().all() and (sc[:used] > 0).all(), name


def test_the_warp_specialized_kernel_is_chosen_only_where_it_can_run(monkeypatch) -> None:
    """``fp8_ws`` (Gluon) runs on a Hopper GPU or in an sm_90a compile check, never in the
    interpreter or on the CPU, and only with 128-row tiles inside each row block; elsewhere
    ``fp8_gemm`` runs its Triton kernel (whose bits the GPU tests compare it with)."""
    from megamoe.kernels import fp8_ws
    from megamoe.kernels.runtime import assume_programs

    cpu = torch.device("cpu")
    assert not fp8_ws.supported(cpu, 128)  # the interpreter
    with assume_programs(132):
        assert not fp8_ws.supported(cpu, 128)  # still the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert fp8_ws.supported(torch.device("meta"), 128)  # an sm_90a compile check
        assert not fp8_ws.supported(torch.device("meta"), 64)  # tiles would cross blocks
    assert not fp8_ws.supported(cpu, 128)  # no GPU, no compile check


def test_the_automatic_walk_groups_row_tiles_where_a_wave_would_reread_an_experts_weights() -> None:
    """``GemmTiles.group_m`` 0: ``walk_group`` groups 8 row tiles where an expert's row tiles
    (at balanced routing) outnumber those the grid covers at once with the columns fast, else
    walks the columns fast; a set group size is kept."""
    from types import SimpleNamespace

    from megamoe.kernels import fp8_ws

    def sched(rows_per_expert: float):
        return SimpleNamespace(balanced_rows=rows_per_expert)

    # Llama-4-Scout's gate/up at 16384 tokens: 8 row tiles an expert, 128 column tiles, 132 CTAs
    assert fp8_ws.walk_group(0, sched(1024), 132, 128) == fp8_ws.AUTO_GROUP_M
    # DeepSeek-V3's: 4 row tiles an expert, 32 column tiles: 132 CTAs cover 4.1 row tiles
    assert fp8_ws.walk_group(0, sched(512), 132, 32) == 1
    assert fp8_ws.walk_group(3, sched(1024), 132, 128) == 3
    assert fp8_ws.walk_group(1, sched(1024), 132, 128) == 1


def test_wide_tiles_run_as_narrow_triton_tiles_and_bad_widths_are_refused() -> None:
    """A wide warp-specialized tile (256 columns; gate/up 128 of each weight) runs on the
    Triton kernels as the narrow tile, whose bits it has (``fp8_gemm.triton_tiles``), and the
    SwiGLU backward's and the weight gradient's (128 or 256 columns) as the split tile;
    other tiles stay as they are. ``fp8_ws``'s launchers refuse another width, a wide SwiGLU
    backward and a ring past the shared memory, each with an error naming it, before
    anything is launched; the defaults fit."""
    from megamoe.kernels import fp8_ws

    wide = fp8_gemm.WIDE
    assert (wide.bn, wide.stages, wide.warp_specialized) == (256, 3, True)
    assert fp8_gemm.triton_tiles("mm", wide) == dataclasses.replace(wide, bn=128)
    assert fp8_gemm.triton_tiles("pair", wide).bn == 128
    assert fp8_gemm.triton_tiles("gate_up", dataclasses.replace(wide, bn=128)).bn == 64
    for kind, t in (("swiglu_bwd", fp8_gemm.WARP_SPECIALIZED), ("wgrad", fp8_gemm.WARP_SPECIALIZED),
                    ("wgrad", fp8_gemm.GPU_TILES["wgrad"])):  # fmt: skip
        split = fp8_gemm.triton_tiles(kind, t)
        assert not split.warp_specialized and split.split_m == 2 and split.programs_per_sm == 2
        assert split.bn == 128
    plain = dataclasses.replace(wide, warp_specialized=False)
    assert fp8_gemm.triton_tiles("mm", plain) is plain
    for kind, t in fp8_gemm.GPU_TILES.items():
        if t.warp_specialized:
            assert fp8_ws.smem_bytes(t.stages, 2, kind, t.bn) <= fp8_ws.SMEM_BYTES, kind

    x = torch.zeros(4, 4, dtype=torch.bfloat16)
    pair = (x, x, x, x, 4)
    with pytest.raises(ValueError, match="cols = 192: the tiles are 128 or 256 columns wide"):
        fp8_ws.launch_grouped_mm([pair], None, [x], 3, cols=192)
    with pytest.raises(ValueError, match="cols = 256: .* 128 with the SwiGLU backward"):
        fp8_ws.launch_grouped_mm([pair], None, [x, x], 3, gu=(x, x), cols=256)
    with pytest.raises(ValueError, match="stages = 4 needs .* with 256-column tiles and the mm"):
        fp8_ws.launch_grouped_mm([pair], None, [x], 4, cols=256)
    with pytest.raises(ValueError, match="cols = 256: gate/up tiles are 64 or 128 columns"):
        fp8_ws.launch_gate_up(x, x, (x, x), (x, x), 4, None, (x, x, x), 3, cols=256)
    with pytest.raises(ValueError, match="stages = 4 needs .* with 128-column tiles and the gate"):
        fp8_ws.launch_gate_up(x, x, (x, x), (x, x), 4, None, (x, x, x), 4, cols=128)
    out = torch.zeros(1, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cols = 192: weight-gradient tiles are 128 or 256"):
        fp8_ws.launch_wgrad(x, x, x, x, x, out, 3, cols=192)
    with pytest.raises(ValueError, match="stages = 4 needs .* with 256-column tiles and the wgrad"):
        fp8_ws.launch_wgrad(x, x, x, x, x, out, 4, cols=256)
    with pytest.raises(ValueError, match="consumers = 3 with cols = 256: .* 3 with 128 columns"):
        fp8_ws.launch_wgrad(x, x, x, x, x, out, 3, cols=256, consumers=3)
    with pytest.raises(ValueError, match="consumers = 4 with cols = 128"):
        fp8_ws.launch_wgrad(x, x, x, x, x, out, 3, cols=128, consumers=4)
    with pytest.raises(ValueError, match="stages = 5 needs .* with 128-column tiles and the wgrad"):
        fp8_ws.launch_wgrad(x, x, x, x, x, out, 5, cols=128, consumers=3)


def test_the_weight_gradient_takes_the_tile_that_pads_its_output_less() -> None:
    """``GPU_TILES["wgrad"].bm`` 0: ``fp8_ws.wgrad_tiles`` picks 192 x 128 tiles of three
    consumers (4 stages) where they pad the [E, M, N] output no more than the wide 128 x 256
    tiles of two (a tie included), else the wide tiles (the entry's columns and stages); both
    fit the shared memory."""
    from megamoe.kernels import fp8_ws

    t = fp8_gemm.GPU_TILES["wgrad"]
    assert t.bm == 0 and t.warp_specialized
    wide, three = (2, t.bn, t.stages), (3, 128, 4)
    for consumers, cols, stages in (wide, three):
        assert fp8_ws.smem_bytes(stages, 2, "wgrad", cols, consumers) <= fp8_ws.SMEM_BYTES
    pick = lambda m, n: fp8_ws.wgrad_tiles(m, n, (t.bn, t.stages))  # noqa: E731
    assert pick(2880, 2880) == three  # GPT-OSS: N % 256 pads the wide tile, M % 192 == 0
    assert pick(4096, 1408) == three  # 1408 columns: the wide tile pads 9%, 192 rows 3%
    assert pick(1536, 2048) == three  # neither pads: a tie
    assert pick(7168, 2048) == wide  # dsv3's down: only 192 rows pad
    assert pick(2048, 2048) == wide
    assert pick(100, 100) == three  # both pad one tile: 192 x 128 is smaller
