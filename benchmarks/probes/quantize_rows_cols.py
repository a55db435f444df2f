"""Probe (one GPU): the backward's activation-gradient quantization in one pass or two.

    PYTHONPATH=. python benchmarks/probes/quantize_rows_cols.py [--out probe.json]

d_z and d_g/d_u each feed a data gradient (1x128 blocks) and a weight gradient (128x1 blocks).
``fp8.quantize_rows_cols`` writes both from one read of the bf16 source; this times it at
several chunk sizes and warp counts beside the two passes it replaces (``quantize_rows`` +
``quantize_cols``) and a bf16 ``copy_`` of the source (the bandwidth anchor), interleaved
rounds, at the sizes of one training step (rows = tokens x top_k). Median ms, and GB/s of the
bytes read + written (one pass: 2 + 1 + 1 bytes per value; two passes: 2 + 1 + 2 + 1). Every
variant must give the two passes' bytes.
"""

import argparse
import json
import statistics

import torch

from megamoe.kernels import fp8
from megamoe.shapes import get_preset
from megamoe.tools.bench_kernels import event_times_ms

CASES = (("dsv3", 4096), ("qwen3-30b", 8192))
# (chunk, warps) of quantize_rows_cols' program; the first is the default
VARIANTS = ((64, 4), (32, 4), (32, 2), (32, 8), (128, 4))


def _bytes(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.view(torch.uint8) if t.dtype == fp8.FP8 else t for t in tensors]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    records = []
    for preset, tokens in CASES:
        cfg = get_preset(preset).config()
        rows = tokens * cfg.top_k
        for name, shape in (
            ("d_z", (rows, cfg.hidden_size)),
            ("d_g, d_u", (2 * rows, cfg.intermediate_size)),
        ):
            x = torch.randn(shape, device=dev, generator=gen).bfloat16()
            copy = torch.empty_like(x)

            def two_passes(x=x):
                return (*fp8.quantize_rows(x), *fp8.quantize_cols(x))

            def one_pass(chunk: int, warps: int, x=x):
                fp8._ROWS_COLS_CHUNK, fp8._ROWS_COLS_WARPS = chunk, warps
                (q, s), (q_t, s_t) = fp8.quantize_rows_cols(x)
                return q, s, q_t, s_t

            cases = {"two passes": two_passes, "copy": lambda c=copy, x=x: (c.copy_(x),)}
            cases.update(
                {f"one pass, {c} x {w}": (lambda c=c, w=w: one_pass(c, w)) for c, w in VARIANTS}
            )
            want = [t.clone() for t in _bytes(*two_passes())]
            times: dict = {key: [] for key in cases}
            for _ in range(args.rounds):
                for key, fn in cases.items():
                    times[key].append(statistics.median(event_times_ms(fn, 10)))
            fp8._ROWS_COLS_CHUNK, fp8._ROWS_COLS_WARPS = VARIANTS[0]
            for key, fn in cases.items():
                ms = statistics.median(times[key])
                nbytes = x.numel() * {"copy": 4, "two passes": 6}.get(key, 4)
                same = (
                    None
                    if key == "copy"
                    else all(torch.equal(a, b) for a, b in zip(_bytes(*fn()), want))
                )
                rec = dict(
                    preset=preset, tokens=tokens, operand=name, shape=list(shape), variant=key,
                    ms=ms, gb_per_s=nbytes / ms / 1e6, same_bits=same,
                )  # fmt: skip
                records.append(rec)
                print(
                    f"{preset:10s} {name:9s} {key:20s} {ms:7.3f} ms {rec['gb_per_s']:7.0f} GB/s"
                    f"  same bits: {same}"
                )
            del x, copy
        if args.out:  # (after every preset: a run cut short keeps what it measured)
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), records=records), f, indent=1)


if __name__ == "__main__":
    main()
