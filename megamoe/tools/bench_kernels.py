"""Benchmark of the Triton grouped GEMMs alone (and the whole triton layer) on one GPU.

``bench_grouped_gemm`` times our kernels against ``torch._grouped_mm`` at the MoE shapes of
the presets (balanced routing, every expert exactly ``rows`` rows), median of per-iteration
CUDA-event times, and returns one dict per (shape, implementation). ``python -m
megamoe.tools.bench_kernels --out results.json`` prints a table and writes the records.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Callable

import torch

from ..shapes import get_preset
from ..types import ExpertWeights

__all__ = ["bench_grouped_gemm", "bench_layer", "GEMM_SHAPES"]

# name -> (experts, rows per expert, hidden, intermediate, what is timed)
GEMM_SHAPES: dict[str, tuple[int, int, int, int, str]] = {
    "dsv3 gate+up": (32, 1024, 7168, 2048, "gate_up"),
    "dsv3 down": (32, 1024, 7168, 2048, "down"),
    "qwen3 gate+up": (64, 512, 2048, 768, "gate_up"),
    "dsv3 down dgrad+swiglu": (32, 1024, 7168, 2048, "dgrad_swiglu"),
    "dsv3 gate+up dgrad": (32, 1024, 7168, 2048, "dgrad_pair"),
    "dsv3 down wgrad": (32, 1024, 7168, 2048, "wgrad_down"),
    "dsv3 gate+up wgrad": (32, 1024, 7168, 2048, "wgrad_gate_up"),
}
_WARMUP = 10


def _time_ms(fn: Callable[[], object], iters: int) -> float:
    """Median over ``iters`` of one call's CUDA-event time, after a warm-up."""
    for _ in range(_WARMUP):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _balanced_ids(tokens: int, experts: int, top_k: int, device: torch.device) -> torch.Tensor:
    """Token t goes to experts t*K .. t*K+K-1 (mod E): distinct, and every expert equally loaded."""
    t = torch.arange(tokens, device=device)[:, None] * top_k + torch.arange(top_k, device=device)
    return (t % experts).to(torch.int64)


def _gpu_name() -> str:
    return torch.cuda.get_device_name()


def bench_grouped_gemm(iters: int = 50) -> list[dict]:
    """TFLOP/s of our grouped GEMM kernels vs ``torch._grouped_mm`` (torch: forward shapes)."""
    from ..kernels import gemm
    from ..kernels.schedule import build_row_schedule

    dev = torch.device("cuda")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    records = []
    for name, (e, rows, h, i, kind) in GEMM_SHAPES.items():
        top_k = 8 if e >= 8 else 1
        tokens = e * rows // top_k
        sched = build_row_schedule(_balanced_ids(tokens, e, top_k, dev), e, 128)
        m = e * rows
        gen = torch.Generator(device=dev).manual_seed(0)

        def rnd(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, device=dev, generator=gen) * 0.05).to(torch.bfloat16)

        x, hh, dz = rnd(m, h), rnd(m, i), rnd(m, h)
        w_gate, w_up, w_down = rnd(e, i, h), rnd(e, i, h), rnd(e, h, i)
        g, u = rnd(m, i), rnd(m, i)
        flops = {
            "gate_up": 2 * m * 2 * i * h,
            "down": 2 * m * h * i,
            "dgrad_swiglu": 2 * m * h * i,
            "dgrad_pair": 2 * m * 2 * i * h,
            "wgrad_down": 2 * m * h * i,
            "wgrad_gate_up": 2 * m * 2 * i * h,
        }[kind]
        ours = {
            "gate_up": lambda: gemm.gate_up(x, w_gate, w_up, sched),
            "down": lambda: gemm.grouped_mm(hh, w_down, sched),
            "dgrad_swiglu": lambda: gemm.dgrad_swiglu(dz, w_down, g, u, sched),
            "dgrad_pair": lambda: gemm.dgrad_pair(g, w_gate, u, w_up, sched),
            "wgrad_down": lambda: gemm.wgrad(dz, hh, sched),
            "wgrad_gate_up": lambda: (gemm.wgrad(g, x, sched), gemm.wgrad(u, x, sched)),
        }[kind]
        impls: dict[str, Callable[[], object]] = {"triton": ours}
        if kind in ("gate_up", "down") and hasattr(torch, "_grouped_mm"):
            offs = (torch.arange(1, e + 1, device=dev) * rows).to(torch.int32)
            if kind == "gate_up":
                w_cat = torch.cat([w_gate, w_up], dim=1).transpose(1, 2)  # [E, H, 2I] view
                impls["torch._grouped_mm"] = lambda: torch._grouped_mm(x, w_cat, offs=offs)
            else:
                w_t = w_down.transpose(1, 2)
                impls["torch._grouped_mm"] = lambda: torch._grouped_mm(hh, w_t, offs=offs)
        for impl, fn in impls.items():
            rec = dict(
                shape=name,
                impl=impl,
                experts=e,
                rows_per_expert=rows,
                hidden=h,
                intermediate=i,
                kernel=kind,
                gpu=_gpu_name(),
                date=date,
            )
            try:
                ms = _time_ms(fn, iters)
                rec.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as exc:  # record and go on: one failing variant must not hide others
                rec.update(error=f"{type(exc).__name__}: {exc}"[:500])
            records.append(rec)
    return records


def bench_layer(preset: str = "dsv3", iters: int = 20) -> dict:
    """Forward and forward+backward of backend "triton" at a preset (W = 1, balanced routing)."""
    from ..backends import triton as backend

    p = get_preset(preset)
    cfg = p.config(1)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(shape, device=dev, generator=gen) * scale).to(torch.bfloat16)

    t, h, i, e, i_s = (
        p.tokens_per_rank,
        p.hidden_size,
        p.intermediate_size,
        p.local_experts,
        p.shared_intermediate_size,
    )
    ids = _balanced_ids(t, e, p.top_k, dev)
    w = torch.softmax(torch.randn((t, p.top_k), device=dev, generator=gen), dim=1)
    shared = (rnd(i_s, h), rnd(i_s, h), rnd(h, i_s)) if i_s else (None, None, None)
    weights = ExpertWeights(rnd(e, i, h), rnd(e, i, h), rnd(e, h, i), *shared)
    x, dy = rnd(t, h, scale=1.0), rnd(t, h, scale=1.0)

    def fwd():
        sched = backend.build_schedule(ids, cfg, None)
        return backend.forward(x, ids, w, weights, cfg, None, sched)

    def fwd_bwd():
        _, ctx = fwd()
        return backend.backward(ctx, dy)

    fwd_ms, fwdbwd_ms = _time_ms(fwd, iters), _time_ms(fwd_bwd, iters)
    flops = cfg.flops_per_token() * t
    return dict(
        preset=preset,
        world_size=1,
        backend="triton",
        gpu=_gpu_name(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        tokens_per_rank=t,
        hidden=h,
        intermediate=i,
        experts=e,
        top_k=p.top_k,
        shared_intermediate=i_s,
        fwd_ms=fwd_ms,
        fwdbwd_ms=fwdbwd_ms,
        bwd_ms=fwdbwd_ms - fwd_ms,
        fwd_tflops=flops / fwd_ms / 1e9,
        fwdbwd_tflops=3 * flops / fwdbwd_ms / 1e9,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Triton grouped-GEMM benchmark (one GPU)")
    parser.add_argument("--out", help="write the records as JSON here")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--layer", nargs="*", default=[], help="also time the layer at presets")
    args = parser.parse_args(argv)
    records = bench_grouped_gemm(args.iters)
    print(f"{'shape':28s} {'impl':18s} {'ms':>8s} {'TFLOP/s':>8s}")
    for r in records:
        if "error" in r:
            print(f"{r['shape']:28s} {r['impl']:18s} ERROR {r['error'][:80]}")
        else:
            print(f"{r['shape']:28s} {r['impl']:18s} {r['ms']:8.3f} {r['tflops']:8.1f}")
    for preset in args.layer:
        rec = bench_layer(preset)
        records.append(rec)
        print(
            f"layer {preset}: fwd {rec['fwd_ms']:.2f} ms ({rec['fwd_tflops']:.0f} TFLOP/s), "
            f"fwd+bwd {rec['fwdbwd_ms']:.2f} ms ({rec['fwdbwd_tflops']:.0f} TFLOP/s)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
