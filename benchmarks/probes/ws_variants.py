"""Probe (one Hopper GPU): variants of the warp-specialized fp8 GEMMs (``fp8_ws``), interleaved.

    python benchmarks/probes/ws_variants.py [--models dsv3 qwen3-30b] [--tokens 4096]
        [--kernels down wgrad_down ...] [--variant 'name={"option": value}' ...]
        [--rounds 10] [--out probe.json]

A variant is a set of keyword options given to every ``fp8_ws`` launcher (``launch_gate_up``,
``launch_grouped_mm``, ``launch_wgrad``), and under "tiles" fields of the kernel's
``fp8_gemm.GPU_TILES`` entries (e.g. ``{"tiles": {"stages": 3}}``); the first one is the
baseline. At each model's shapes
(the routed experts at W = 1 with ``--tokens`` tokens, as the tile sweep makes them) each fp8
GEMM of the bench runs under every variant in turn, ``--rounds`` rounds of ``--iters`` calls
each. Once a round, each variant's output (poisoned buffers) is compared bitwise with the Triton
kernels' (``fp8_gemm.triton_tiles``): a variant that races, or leaves an element unwritten,
shows as elements off. Prints and records the median ms, TFLOP/s and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics

import torch

from megamoe.kernels import fp8_gemm, fp8_ws
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.tools.bench_kernels import KERNELS, _flops, event_times_ms, gemm_shapes, kernel_calls
from megamoe.tools.sweep_tiles import FP8_TILE_KIND

LAUNCHERS = ("launch_gate_up", "launch_grouped_mm", "launch_wgrad")


def _variant(text: str) -> tuple[str, dict]:
    name, _, options = text.partition("=")
    return name, json.loads(options or "{}")


def _bits(out, used: int) -> list[torch.Tensor]:
    """The output tensors' bytes; of row outputs (the padded row layout) the ``used`` rows."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [(o[:used] if o.dim() == 2 else o).contiguous().view(torch.uint8) for o in outs]


def _elements_off(out, ref: list[torch.Tensor], used: int) -> int:
    return sum(int((a != b).sum()) for a, b in zip(_bits(out, used), ref))


def _reference(fn, tile_kinds: list[str]) -> callable:
    """``fn`` on the Triton kernels (the warp-specialized tiles' ``triton_tiles``)."""
    old = {k: fp8_gemm.GPU_TILES[k] for k in tile_kinds}
    fp8_gemm.GPU_TILES.update({k: fp8_gemm.triton_tiles(k, t) for k, t in old.items()})
    try:
        return fn()
    finally:
        fp8_gemm.GPU_TILES.update(old)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dsv3", "qwen3-30b"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--variant", action="append", type=_variant)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    variants = dict(args.variant or [("default", {})])
    launchers = {name: getattr(fp8_ws, name) for name in LAUNCHERS}
    records = []
    for name, e, rows, h, i in gemm_shapes(args.models, args.tokens):
        try:
            calls, sched = kernel_calls(e, rows, h, i, ("fp8",))
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"{name}: its {e} experts' operands do not fit this GPU's memory; skipped")
            continue
        used = int(sched.num_blocks.item()) * sched.block_rows
        for kernel in args.kernels:
            fn = calls["triton-fp8"][kernel]
            kinds = [k for k in fp8_gemm.GPU_TILES if k.startswith("wgrad")]
            kinds = kinds if kernel.startswith("wgrad") else [FP8_TILE_KIND[kernel]]
            times = {v: [] for v in variants}
            off = dict.fromkeys(variants, 0)
            defaults = {k: fp8_gemm.GPU_TILES[k] for k in kinds}
            try:
                ref = [b.clone() for b in _bits(_reference(fn, kinds), used)]
                for _ in range(args.rounds):
                    for v, options in variants.items():
                        options = dict(options)
                        tiles = options.pop("tiles", {})
                        for launcher, launch in launchers.items():
                            setattr(fp8_ws, launcher, functools.partial(launch, **options))
                        for k in kinds:
                            fp8_gemm.GPU_TILES[k] = dataclasses.replace(defaults[k], **tiles)
                        with poisoned_buffers():
                            off[v] += _elements_off(fn(), ref, used)
                        times[v] += event_times_ms(fn, args.iters)
            except torch.OutOfMemoryError:
                print(f"{name} {kernel}: out of this GPU's memory; skipped")
                continue
            finally:
                for launcher, launch in launchers.items():
                    setattr(fp8_ws, launcher, launch)
                fp8_gemm.GPU_TILES.update(defaults)
            base = statistics.median(times[next(iter(variants))])
            for v, options in variants.items():
                ms = statistics.median(times[v])
                tflops = _flops(kernel, e * rows, h, i) / ms / 1e9
                records.append(dict(
                    shape=name, tokens=args.tokens, experts=e, rows_per_expert=rows, hidden=h,
                    intermediate=i, kernel=kernel, variant=v, options=options, ms=ms,
                    tflops=tflops, vs_baseline=base / ms, elements_off=off[v],
                    checked_runs=args.rounds,
                ))  # fmt: skip
                print(f"{name:20s} {kernel:13s} {v:16s} {ms:7.3f} ms {tflops:6.0f} TFLOP/s "
                      f"{base / ms:5.3f}x  off {off[v]}", flush=True)  # fmt: skip
        del calls
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), records=records), f, indent=1)


if __name__ == "__main__":
    main()
