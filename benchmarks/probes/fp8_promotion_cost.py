"""Probe (one GPU): what does the block-scale promotion cost an fp8 tile? The library's fp8
GEMMs run at ~750-850 TFLOP/s, 40% of the fp8 peak, against cuBLAS's ~1250-1400 with one scale
per row. Each variant here runs one persistent tile of a dense C = A W^T at dsv3's gate/up and
down sizes:

- ``plain``: no block scales, the tensor core accumulates over all of K (``tl.dot(a, b, acc)``):
  the tile's own ceiling (operand bytes, pipeline), whatever the promotion does;
- ``promote, scales once``: the promotion ``acc += dot(a, b) * scale`` every 128 of K, with one
  scale per row loaded once per tile: the promotion's cost without the per-step scale loads;
- ``promote`` (the library's ``fp8_gemm.fp8_mma`` with ``row_scales`` / ``weight_scales`` per K
  step): what the library runs;
- ``promote, two 64-row halves``: a 128 x 128 tile in one warpgroup (4 warps, two programs per
  SM) as two 64-row halves sharing each B tile, each half promoted before the other's MMA: the
  128 x 128 tile's operand bytes per FLOP, and the other program's MMAs run while this one
  promotes. As written, ptxas sets up the second half's zero accumulator while the first half's
  partial product is live (255 registers, spills); ``late zero`` makes that zero from the
  first half's promoted accumulator (an opaque ``mov``), so it cannot be hoisted: 234
  registers, no spills.

    PYTHONPATH=. python benchmarks/probes/fp8_promotion_cost.py [--out probe.json]

Beside them the library's ``fp8_gemm.grouped_mm`` (one expert), cuBLAS rowwise fp8 and cuBLAS
bf16, in interleaved rounds. The ``promote`` variants must give the library's bits; the others
compute other sums and are timed only.
"""

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from megamoe.kernels import fp8, fp8_gemm
from megamoe.kernels.runtime import descriptor, persistent_programs
from megamoe.kernels.schedule import uniform_schedule
from megamoe.kernels.tiles import tile_of
from megamoe.tools.bench_kernels import event_times_ms

SHAPES = {"dsv3 gate (K 7168)": (32768, 2048, 7168), "dsv3 down (K 2048)": (32768, 7168, 2048)}
PLAIN, ONCE, PROMOTE, HALVES, HALVES_Z = 0, 1, 2, 3, 4
MODES = {
    PLAIN: "plain",
    ONCE: "promote, scales once",
    PROMOTE: "promote",
    HALVES: "promote, two 64-row halves",
    HALVES_Z: "promote, two 64-row halves, late zero",
}
# (BM, BN, warps, stages, programs per SM, modes)
TILES = [
    (64, 128, 4, 3, 2, (PLAIN, ONCE, PROMOTE)),  # the library's tile
    (128, 128, 8, 4, 1, (PLAIN, ONCE, PROMOTE)),
    (128, 256, 8, 3, 1, (PLAIN,)),  # promoted, it spills (fp8_split_n)
    (64, 256, 4, 3, 1, (PLAIN,)),
    (128, 128, 4, 2, 2, (HALVES, HALVES_Z)),
    (128, 128, 4, 3, 2, (HALVES_Z,)),
]


@triton.jit
def _halves_tile(
    a_desc, a_s_ptr, b_desc, b_s_ptr, c_desc, row, col, M, K, s_am, s_ak, s_bn, s_bk,
    HM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ZERO_AFTER: tl.constexpr,
):  # fmt: skip
    """A 2*HM x BN tile in one warpgroup as two HM-row halves sharing each B tile, each half's
    partial product promoted before the other half's MMA: the 128 x 128 tile's operand bytes
    per FLOP with one half-tile partial product live."""
    acc0 = tl.zeros([HM, BN], dtype=tl.float32)
    acc1 = tl.zeros([HM, BN], dtype=tl.float32)
    for kb in range(tl.cdiv(K, BK)):
        k = kb * BK
        sb = tl.load(b_s_ptr + (col // 128) * s_bn + kb * s_bk)
        b = b_desc.load([col, k]).T
        sa0 = fp8_gemm.row_scales(a_s_ptr, row, kb, M, s_am, s_ak, HM)
        acc0 = fp8_gemm.fp8_mma(acc0, a_desc.load([row, k]), b, sa0, sb, False)
        sa1 = fp8_gemm.row_scales(a_s_ptr, row + HM, kb, M, s_am, s_ak, HM)
        if ZERO_AFTER:
            # the second half's zero accumulator made from the first half's promoted result, so
            # that it cannot be set up while the first half's partial product is still live
            zero = tl.inline_asm_elementwise(
                "mov.b32 $0, 0;", "=r,r", [acc0], dtype=tl.float32, is_pure=True, pack=1
            )
            d1 = tl.dot(a_desc.load([row + HM, k]), b, zero)
            acc1 = acc1 + d1 * (sa1 * sb)
        else:
            acc1 = fp8_gemm.fp8_mma(acc1, a_desc.load([row + HM, k]), b, sa1, sb, False)
    c_desc.store([row, col], acc0.to(tl.bfloat16))
    c_desc.store([row + HM, col], acc1.to(tl.bfloat16))


@triton.jit
def _tile_kernel(
    a_desc, a_s_ptr, b_desc, b_s_ptr, c_desc, M, N, K, s_am, s_ak, s_bn, s_bk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr,
    NUM_PROGS: tl.constexpr,
):  # fmt: skip
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tiles_n, NUM_PROGS):
        mb, nb = tile_of(tile, tiles_n)
        row, col = mb * BM, nb * BN
        if MODE >= 3:
            _halves_tile(
                a_desc,
                a_s_ptr,
                b_desc,
                b_s_ptr,
                c_desc,
                row,
                col,
                M,
                K,
                s_am,
                s_ak,
                s_bn,
                s_bk,
                BM // 2,
                BN,
                BK,
                MODE == 4,
            )
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            once = fp8_gemm.row_scales(a_s_ptr, row, 0, M, s_am, s_ak, BM) * tl.load(
                b_s_ptr + (col // 128) * s_bn
            )
            for kb in range(tl.cdiv(K, BK)):
                k = kb * BK
                a = a_desc.load([row, k])
                b = b_desc.load([col, k]).T
                if MODE == 0:
                    acc = tl.dot(a, b, acc)
                elif MODE == 1:
                    acc = acc + tl.dot(a, b) * once
                else:
                    sa = fp8_gemm.row_scales(a_s_ptr, row, kb, M, s_am, s_ak, BM)
                    sb = tl.load(b_s_ptr + (col // 128) * s_bn + kb * s_bk)
                    acc = fp8_gemm.fp8_mma(acc, a, b, sa, sb, False)
            c_desc.store([row, col], acc.to(tl.bfloat16))


def _label(bm, bn, warps, stages, per_sm, mode) -> str:
    return f"{bm}x{bn}, {warps} warps, {stages} stages, {per_sm}/SM: {MODES[mode]}"


def _variant(aq, a_s, w8, bm, bn, warps, stages, per_sm, mode):
    (m, k), n = aq.shape, w8.q.shape[1]
    c = torch.empty(m, n, dtype=torch.bfloat16, device=aq.device)
    b2 = w8.q[0]
    grid = (min(persistent_programs(aq.device) * per_sm, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    hm = bm // 2 if mode >= HALVES else bm  # the A and C blocks of one half
    args = (
        descriptor(aq, [hm, 128]), a_s, descriptor(b2, [bn, 128]), w8.scale[0],
        descriptor(c, [hm, bn]), m, n, k, *a_s.stride(), *w8.scale[0].stride(),
    )  # fmt: skip

    def run():
        _tile_kernel[grid](
            *args, BM=bm, BN=bn, BK=128, MODE=mode, NUM_PROGS=grid[0], num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
        return c

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    records = []
    for shape, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, device=dev, generator=gen).bfloat16()
        w = (torch.randn(1, n, k, device=dev, generator=gen) / k**0.5).bfloat16()
        aq, a_s = fp8.quantize_rows(a)
        w8 = fp8.quantize_weight(w)
        sched = uniform_schedule(m, 128, dev)
        cases = {"library fp8_gemm.grouped_mm": lambda: fp8_gemm.grouped_mm(aq, a_s, w8, sched)}
        modes = {}
        for bm, bn, warps, stages, per_sm, tile_modes in TILES:
            for mode in tile_modes:
                name = _label(bm, bn, warps, stages, per_sm, mode)
                cases[name] = _variant(aq, a_s, w8, bm, bn, warps, stages, per_sm, mode)
                modes[name] = mode
        a_row, b_col, w_t = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev), w8.q[0].t()
        cases["cuBLAS fp8 rowwise (_scaled_mm)"] = lambda: torch._scaled_mm(
            aq, w_t, a_row, b_col, out_dtype=torch.bfloat16
        )
        w_bf16 = w[0].t()
        cases["cuBLAS bf16 (mm)"] = lambda: torch.mm(a, w_bf16)
        library = cases["library fp8_gemm.grouped_mm"]().clone()
        promoted = [name for name in modes if modes[name] >= PROMOTE]
        same = {name: torch.equal(cases[name](), library) for name in promoted}
        times: dict = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                times[name].append(statistics.median(event_times_ms(fn, 10)))
        base = statistics.median(times["library fp8_gemm.grouped_mm"])
        for name in cases:
            ms = statistics.median(times[name])
            rec = dict(
                shape=shape, m=m, n=n, k=k, variant=name, ms=ms,
                tflops=2 * m * n * k / ms / 1e9, vs_library=base / ms, same_bits=same.get(name),
            )  # fmt: skip
            records.append(rec)
            print(
                f"{shape:20s} {name:52s} {ms:7.3f} ms {rec['tflops']:6.0f} TFLOP/s "
                f"{rec['vs_library']:5.2f}x  same bits: {rec['same_bits']}",
                flush=True,
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), records=records), f, indent=1)


if __name__ == "__main__":
    main()
