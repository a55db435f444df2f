"""Probe (one GPU): how close do the fp8 quantizers come to the H200's memory bandwidth, and
which tile and warp count of ``fp8._quantize_rows_kernel`` / ``_quantize_cols_kernel`` is
fastest? The training step's profile puts them at 2.7 ms of a 30.6 ms DeepSeek-V3-shaped fp8
step. Every variant must give the default's bits (the blocks and their arithmetic do not
change, only how many of them one program handles).

    PYTHONPATH=. python benchmarks/probes/quantize_tiles.py [--out probe.json]

Operands of the layer's sizes (rows x features, bf16; and the fp8 packed rows the column
quantizer requantizes), interleaved rounds, median ms, GB/s of bytes read + written.
"""

import argparse
import json
import statistics

import torch
import triton

from megamoe.kernels import fp8
from megamoe.tools.bench_kernels import event_times_ms

SHAPES = {"dsv3 x / dy": (32768, 7168), "dsv3 h": (32768, 2048), "qwen3-30b dg": (65536, 768)}
ROWS_VARIANTS = [(32, 4), (16, 4), (64, 4), (64, 8), (128, 8)]  # (ROWS, num_warps); first: default
COLS_VARIANTS = [(32, 4), (64, 4), (64, 8), (128, 8), (128, 16)]  # (COLS, num_warps)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an fp8 tensor (compared as uint8: not every device's eq takes fp8)."""
    return t.view(torch.uint8) if t.dtype == fp8.FP8 else t


def rows_call(x, rows, warps):
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8.FP8, device=x.device)
    s = torch.empty((triton.cdiv(k, 128), m), dtype=torch.float32, device=x.device).t()

    def run():
        fp8._quantize_rows_kernel[(triton.cdiv(m, rows), triton.cdiv(k, 128))](
            x, q, s, m, k, x.stride(0), x.stride(1), q.stride(0), s.stride(0), s.stride(1),
            ROWS=rows, UPCAST=False, num_warps=warps,
        )  # fmt: skip
        return q, s

    return run


def cols_call(x, row_scale, cols, warps):
    m, k = x.shape
    mb = triton.cdiv(m, 128)
    q_t = torch.empty((k, m), dtype=fp8.FP8, device=x.device)
    s = torch.empty((mb, k), dtype=torch.float32, device=x.device).t()
    rs = x if row_scale is None else row_scale

    def run():
        fp8._quantize_cols_kernel[(mb, triton.cdiv(k, cols))](
            x, rs, q_t, s, m, k, x.stride(0), x.stride(1), rs.stride(0), rs.stride(1),
            s.stride(0), s.stride(1), COLS=cols, DEQUANT=row_scale is not None, UPCAST=False,
            num_warps=warps,
        )  # fmt: skip
        return q_t, s

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    records = []
    for shape_name, (m, k) in SHAPES.items():
        x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
        q_rows, s_rows = fp8.quantize_rows(x)
        cases = {}
        for rows, warps in ROWS_VARIANTS:
            cases["rows", rows, warps] = (rows_call(x, rows, warps), m * k * 3)
        for cols, warps in COLS_VARIANTS:
            cases["cols", cols, warps] = (cols_call(x, None, cols, warps), m * k * 3)
            cases["requant cols", cols, warps] = (
                cols_call(q_rows, s_rows, cols, warps),
                m * k * 2,
            )
        bits = {key: [t.clone() for t in fn()] for key, (fn, _) in cases.items()}
        times: dict = {key: [] for key in cases}
        for _ in range(args.rounds):
            for key, (fn, _) in cases.items():
                times[key].append(statistics.median(event_times_ms(fn, 10)))
        for key, (fn, nbytes) in cases.items():
            kind, tile, warps = key
            default = next(c for c in cases if c[0] == kind)
            same = all(torch.equal(_raw(a), _raw(b)) for a, b in zip(bits[key], bits[default]))
            ms = statistics.median(times[key])
            rec = dict(
                shape=shape_name, rows=m, features=k, kernel=kind, tile=tile, num_warps=warps,
                default=key == default, ms=ms, gb_per_s=nbytes / ms / 1e6, same_bits=same,
            )  # fmt: skip
            records.append(rec)
            print(
                f"{shape_name:14s} {kind:13s} tile {tile:3d} warps {warps:2d}  {ms:7.3f} ms "
                f"{rec['gb_per_s']:7.0f} GB/s  same bits: {same}"
            )
    out = dict(gpu=torch.cuda.get_device_name(), records=records)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
