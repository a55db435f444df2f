"""Probe (one GPU): can wider fp8 tiles beat the 64 x 128 ones if the block-scale promotion is
split along N? The library's fp8 GEMMs promote each 128-deep K step's partial product
(``fp8_mma``: ``acc += dot(a, b) * scales``), so a tile holds its accumulator and the step's
partial product in registers at once; that caps a 4-warp tile at 64 x 128, whose operand bytes
per FLOP are high. Splitting the tile's N into halves, each with its own accumulator, issues
both halves' MMAs before promoting the first (it can overlap the second's MMA) and keeps only a
half-width partial product live: 64 x 256 in 4 warps, 128 x 256 in 8.

    PYTHONPATH=. python benchmarks/probes/fp8_split_n.py [--out probe.json]

A dense fp8 GEMM C = A W^T (A 1x128-scaled [M, K], W 128x128-scaled [N, K]) at dsv3's gate/up
and down sizes, persistent, per tile variant; beside the library's ``fp8_gemm.grouped_mm`` (one
expert: the same product), cuBLAS rowwise fp8 (``torch._scaled_mm``) and bf16 (``torch.mm``),
interleaved rounds. Every variant must give the library's bits (each output element is the same
sum of the same 128-deep partial products in K order).
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
# (BM, BN, SPLIT, both halves' MMAs before the promotions, warps, stages, programs per SM)
VARIANTS = [
    (64, 128, 1, False, 4, 3, 2),  # the library's tile, re-built here
    (64, 128, 2, True, 4, 3, 2),
    (64, 256, 2, False, 4, 3, 1),
    (64, 256, 2, False, 4, 2, 2),
    (64, 256, 2, True, 4, 3, 1),
    (128, 128, 1, False, 8, 4, 1),
    (128, 256, 2, False, 8, 3, 1),
    (128, 256, 2, False, 8, 4, 1),
    (128, 256, 2, True, 8, 4, 1),
]


@triton.jit
def _split_n_kernel(
    a_desc, a_s_ptr, b_desc, b_s_ptr, c_desc, M, N, K, s_am, s_ak, s_bn, s_bk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
    ISSUE_BOTH: tl.constexpr, NUM_PROGS: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = BN // SPLIT
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tiles_n, NUM_PROGS):
        mb, nb = tile_of(tile, tiles_n)
        row, col = mb * BM, nb * BN
        acc0 = tl.zeros([BM, HALF], dtype=tl.float32)
        acc1 = tl.zeros([BM, HALF], dtype=tl.float32)
        for kb in range(tl.cdiv(K, BK)):
            k = kb * BK
            sa = fp8_gemm.row_scales(a_s_ptr, row, kb, M, s_am, s_ak, BM)
            a = a_desc.load([row, k])
            d0 = tl.dot(a, b_desc.load([col, k]).T)
            s0 = tl.load(b_s_ptr + (col // 128) * s_bn + kb * s_bk)
            if SPLIT == 2:
                s1 = tl.load(b_s_ptr + ((col + HALF) // 128) * s_bn + kb * s_bk)
                if ISSUE_BOTH:  # both halves' MMAs, then both promotions
                    d1 = tl.dot(a, b_desc.load([col + HALF, k]).T)
                    acc0 = acc0 + d0 * (sa * s0)
                    acc1 = acc1 + d1 * (sa * s1)
                else:  # one half-width partial product live at a time
                    acc0 = acc0 + d0 * (sa * s0)
                    d1 = tl.dot(a, b_desc.load([col + HALF, k]).T)
                    acc1 = acc1 + d1 * (sa * s1)
            else:
                acc0 = acc0 + d0 * (sa * s0)
        c_desc.store([row, col], acc0.to(tl.bfloat16))
        if SPLIT == 2:
            c_desc.store([row, col + HALF], acc1.to(tl.bfloat16))


def _label(variant) -> str:
    bm, bn, split, issue_both, warps, stages, per_sm = variant
    order = " (both MMAs first)" if issue_both else ""
    return f"{bm}x{bn} split {split}{order}, {warps} warps, {stages} stages, {per_sm}/SM"


def _variant(aq, a_s, w8, variant):
    bm, bn, split, issue_both, warps, stages, per_sm = variant
    (m, k), n = aq.shape, w8.q.shape[1]
    c = torch.empty(m, n, dtype=torch.bfloat16, device=aq.device)
    b2 = w8.q[0]
    grid = (min(persistent_programs(aq.device) * per_sm, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    args = (
        descriptor(aq, [bm, 128]), a_s, descriptor(b2, [bn // split, 128]), w8.scale[0],
        descriptor(c, [bm, bn // split]), m, n, k, *a_s.stride(), *w8.scale[0].stride(),
    )  # fmt: skip

    def run():
        _split_n_kernel[grid](
            *args, BM=bm, BN=bn, BK=128, SPLIT=split, ISSUE_BOTH=issue_both, NUM_PROGS=grid[0],
            num_warps=warps, num_stages=stages,
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
        for v in VARIANTS:
            cases[_label(v)] = _variant(aq, a_s, w8, v)
        # cuBLAS anchors on the same sizes: rowwise-scaled fp8, bf16
        a_row = torch.ones(m, 1, device=dev)
        w_t = w8.q[0].t()
        b_col = torch.ones(1, n, device=dev)
        cases["cuBLAS fp8 rowwise (_scaled_mm)"] = lambda: torch._scaled_mm(
            aq, w_t, a_row, b_col, out_dtype=torch.bfloat16
        )
        w_bf16 = w[0].t()
        cases["cuBLAS bf16 (mm)"] = lambda: torch.mm(a, w_bf16)
        library = cases["library fp8_gemm.grouped_mm"]().clone()
        same = {
            name: torch.equal(fn(), library) for name, fn in cases.items() if "cuBLAS" not in name
        }
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
                f"{shape:20s} {name:48s} {ms:7.3f} ms {rec['tflops']:6.0f} TFLOP/s "
                f"{rec['vs_library']:5.2f}x  same bits: {rec['same_bits']}"
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), records=records), f, indent=1)


if __name__ == "__main__":
    main()
