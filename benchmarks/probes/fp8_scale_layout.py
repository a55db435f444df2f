"""Probe (one GPU): does the fp8 gate/up GEMM lose time reading its 1x128 activation scales
row-major (one 4-byte load per row and K step, the packed rows' layout after the dispatch)
instead of MN-major (one contiguous load per tile, ``quantize_rows``' layout)?

    PYTHONPATH=. python benchmarks/probes/fp8_scale_layout.py [--out probe.json]

dsv3's routed gate/up at W = 1 (32 experts x 1024 rows, H 7168, I 2048), the same operands in
both layouts (the outputs must be bitwise equal), interleaved rounds, median ms; also the cost
of copying the scales to MN-major.
"""

import argparse
import json
import statistics

import torch

from megamoe.kernels import fp8, fp8_gemm
from megamoe.kernels.schedule import build_row_schedule
from megamoe.tools.bench_kernels import event_times_ms, rows_padded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device("cuda")
    e, rows, h, i = 32, 1024, 7168, 2048
    sched = build_row_schedule(torch.arange(e * rows, device=dev)[:, None] // rows, e, 128)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = rows_padded(torch.randn(e * rows, h, device=dev, generator=gen).bfloat16(), sched)
    w = [
        fp8.quantize_weight(torch.randn(e, i, h, device=dev, generator=gen).bfloat16() * 0.05)
        for _ in range(2)
    ]
    q, s_rows = fp8.unpack_rows(fp8.quantize_packed(x), h)
    s_mn = s_rows.t().contiguous().t()
    calls = {
        "row-major (packed)": lambda: fp8_gemm.gate_up(q, s_rows, *w, sched),
        "MN-major": lambda: fp8_gemm.gate_up(q, s_mn, *w, sched),
        "MN-major copy": lambda: s_rows.t().contiguous(),
    }
    used = int(sched.num_blocks.item()) * sched.block_rows  # (rows past it are not written)
    ref = calls["row-major (packed)"]()
    same = all(torch.equal(a[:used], b[:used]) for a, b in zip(ref, calls["MN-major"]()))
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(5):
        for name, fn in calls.items():
            times[name].append(statistics.median(event_times_ms(fn, 10)))
    rec = {name: statistics.median(t) for name, t in times.items()}
    rec.update(same_bits=same, gpu=torch.cuda.get_device_name(), shape="dsv3 gate/up W=1")
    print(json.dumps(rec, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
