"""Probe (one GPU): the fp8 backward's route grad writing d_z quantized
(``rows.route_grad(..., quantize=True)``) against the two kernels it replaces (the route grad
writing bf16 d_z, then ``fp8.quantize_rows_cols`` of it), interleaved.

    PYTHONPATH=. python benchmarks/probes/route_grad_fp8.py [--models dsv3 qwen3-30b]
        [--tokens 4096] [--tiles 64,4 32,4 ...] [--rounds 10] [--out probe.json]

Per model (the routed experts at W = 1 with ``--tokens`` tokens, balanced routing, as the
kernels-alone bench makes them; dy as its packed fp8 rows, by token): median ms of each way,
the fused kernel at each ``--tiles`` (chunk, warps) with its ratio and its GB/s of memory
traffic (dy's packed rows and z read, d_z's two quantizations written), and whether every
way's bytes and scales are the same (every round).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from megamoe.kernels import fp8, rows
from megamoe.kernels.schedule import build_row_schedule
from megamoe.shapes import MODEL_SHAPES, get_preset
from megamoe.tools.bench_kernels import _balanced_ids, event_times_ms, gemm_shapes


def _bits(quantized, used: int) -> list[torch.Tensor]:
    """The bytes and scales of the ``used`` rows' two quantizations."""
    (q, s), (q_t, s_t) = quantized
    return [
        q[:used].view(torch.uint8),
        s[:used],
        q_t[:, :used].view(torch.uint8),
        s_t[:, : used // 128],
    ]


def _measure(name: str, e: int, h: int, args, gen: torch.Generator) -> dict:
    """One model's record (see the module docstring)."""
    dev = gen.device
    top_k = MODEL_SHAPES[name].top_k if name in MODEL_SHAPES else get_preset(name).top_k
    sched = build_row_schedule(_balanced_ids(args.tokens, e, top_k, dev), e, 128)
    packed = fp8.quantize_packed(torch.randn(args.tokens, h, device=dev, generator=gen).bfloat16())
    w = torch.rand(args.tokens, top_k, device=dev, generator=gen)
    z = torch.randn(sched.rows, h, device=dev, generator=gen).bfloat16()

    def fused(chunk: int, warps: int):
        def run():
            rows._QUANT_CHUNK, rows._QUANT_WARPS = chunk, warps
            return rows.route_grad(packed, z, w, sched, quantize=True)[0]

        return run

    ways = {"two kernels": lambda: fp8.quantize_rows_cols(rows.route_grad(packed, z, w, sched)[0])}
    ways.update({f"fused {c}x{n}": fused(c, n) for c, n in args.tiles})
    used = int(sched.num_blocks) * 128
    times: dict[str, list[float]] = {way: [] for way in ways}
    same = True
    for _ in range(args.rounds):
        outs = {way: _bits(fn(), used) for way, fn in ways.items()}
        first, *others = outs.values()
        same &= all(torch.equal(a, b) for o in others for a, b in zip(first, o))
        for way, fn in ways.items():
            times[way] += event_times_ms(fn, args.iters)
    ms = {way: statistics.median(t) for way, t in times.items()}
    base = ms.pop("two kernels")
    nbytes = used * (fp8.packed_width(h) * 2 + 2 * h + 2 * h)  # dy rows, z, q and q_t
    fused = {way: dict(ms=t, speedup=base / t, gb_per_s=nbytes / t / 1e6) for way, t in ms.items()}
    return dict(
        shape=name, tokens=args.tokens, experts=e, top_k=top_k, hidden=h, rows=used,
        ms_two_kernels=base, fused=fused, same_bits=bool(same), checked_runs=args.rounds,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dsv3", "qwen3-30b"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--tiles",
        nargs="+",
        default=[(128, 4), (128, 8), (128, 16), (64, 4), (64, 8)],
        type=lambda t: tuple(int(v) for v in t.split(",")),
        help="the fused kernel's (chunk, warps) to time; the first is the library's",
    )
    p.add_argument("--out")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    library = rows._QUANT_CHUNK, rows._QUANT_WARPS
    for name, e, _, h, _ in gemm_shapes(args.models, args.tokens):
        try:
            rec = _measure(name, e, h, args, gen)
        finally:
            rows._QUANT_CHUNK, rows._QUANT_WARPS = library
        records.append(rec)
        fused = ", ".join(
            f"{way} {f['ms']:.3f} ms ({f['speedup']:.2f}x, {f['gb_per_s']:.0f} GB/s)"
            for way, f in rec["fused"].items()
        )
        print(
            f"{name:18s} H {h:5d} rows {rec['rows']:6d}: two kernels {rec['ms_two_kernels']:.3f}"
            f" ms; {fused}; same bits {rec['same_bits']}",
            flush=True,
        )
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), records=records), f, indent=1)


if __name__ == "__main__":
    main()
