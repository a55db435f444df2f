"""Probe (one GPU): what quantizing the expert weights costs per optimizer step, and how close
``fp8.quantize_weight`` (128x128 blocks, with the transposed copy) comes to the H200's memory
bandwidth. The fp8 layer bench counts this in every step (the weights change every step).

    PYTHONPATH=. python benchmarks/probes/quantize_weights.py [--out probe.json]

Per preset's weight shapes (one rank's experts, bf16): ``_quantize_weight_kernel`` at several
warp counts writing both layouts, and at the default warps writing only q (what a forward
without the weight cache quantizes) or only q_t (its backward), beside a plain ``copy_`` of the
same bf16 weight (the bandwidth anchor, same run, interleaved rounds); median ms and GB/s of
bytes read + written. Every variant must give the default's bytes of what it writes.
"""

import argparse
import json
import os
import statistics

import torch
import triton

from megamoe.kernels import fp8
from megamoe.shapes import get_preset
from megamoe.tools.bench_kernels import event_times_ms

PRESETS = ("dsv3", "qwen3-30b")
# (writes q, writes q_t, warps); the first is the default
WARPS = fp8._WEIGHT_WARPS
VARIANTS = [(True, True, WARPS), (True, True, 8), (True, True, 4), (True, False, WARPS),
            (False, True, WARPS)]  # fmt: skip


def _call(w: torch.Tensor, plain: bool, transposed: bool, warps: int):
    e, n, k = w.shape
    nb, kb = triton.cdiv(n, 128), triton.cdiv(k, 128)
    q = torch.empty((e, n, k), dtype=fp8.FP8, device=w.device)
    s = torch.empty((e, nb, kb), dtype=torch.float32, device=w.device)
    q_t = torch.empty((e, k, n), dtype=fp8.FP8, device=w.device)
    s_t = torch.empty((e, kb, nb), dtype=torch.float32, device=w.device)

    def run():
        fp8._quantize_weight_kernel[(e, nb, kb)](
            w, q, s, q_t, s_t, n, k, *w.stride(), PLAIN=plain, TRANSPOSED=transposed,
            UPCAST=False, num_warps=warps,
        )  # fmt: skip
        return ((q.view(torch.uint8), s) if plain else ()) + (
            (q_t.view(torch.uint8), s_t) if transposed else ()
        )

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    records = []
    for preset in PRESETS:
        cfg = get_preset(preset).config()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        # gate and up [E, I, H], down [E, H, I]: the three the layer quantizes every step
        for name, shape in (("gate or up", (e, i, h)), ("down", (e, h, i))):
            w = torch.randn(shape, device=dev, generator=gen).bfloat16()
            copy = torch.empty_like(w)
            cases = {v: _call(w, *v) for v in VARIANTS}
            cases["copy"] = lambda c=copy, w=w: (c.copy_(w),)
            bits = {v: [t.clone() for t in cases[v]()] for v in VARIANTS}
            times: dict = {key: [] for key in cases}
            for _ in range(args.rounds):
                for key, fn in cases.items():
                    times[key].append(statistics.median(event_times_ms(fn, 10)))
            for key in cases:
                ms = statistics.median(times[key])
                if key == "copy":
                    nbytes, same, label = 4 * w.numel(), None, "bf16 copy_"
                else:
                    plain, transposed, warps = key
                    nbytes = w.numel() * (2 + plain + transposed)
                    default = bits[VARIANTS[0]]
                    want = (default[:2] if plain else []) + (default[2:] if transposed else [])
                    same = all(torch.equal(a, b) for a, b in zip(bits[key], want, strict=True))
                    layouts = "q + q_t" if plain and transposed else ("q" if plain else "q_t")
                    label = f"{layouts}, {warps} warps"
                rec = dict(
                    preset=preset, weight=name, shape=list(shape), variant=label, ms=ms,
                    gb_per_s=nbytes / ms / 1e6, same_bits=same,
                )  # fmt: skip
                records.append(rec)
                print(
                    f"{preset:10s} {name:10s} {label:18s} {ms:7.3f} ms {rec['gb_per_s']:7.0f} GB/s"
                    f"  same bits: {same}"
                )
            del w, copy, cases, bits
        if args.out:  # (after every preset: a run cut short keeps what it measured)
            with open(args.out, "w") as f:
                meta = dict(
                    gpu=torch.cuda.get_device_name(), commit=os.environ.get("MEGAMOE_COMMIT")
                )
                json.dump(dict(meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
