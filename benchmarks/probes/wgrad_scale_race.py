"""Whether the warp-specialized weight gradient ever reads overwritten column scales: its
output against the Triton split tiles' (bitwise), several runs on poisoned buffers, for 3 and 4
ring stages, at dsv3's preset shape and a small one. Prints the mismatched elements a run.

  python benchmarks/probes/wgrad_scale_race.py [--runs 8]

(The first version of the column scales through the ring, without a proxy fence between the
consumers' reads and the slot's release, had 0-160 elements a run off with 3 stages.)"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megamoe.kernels import fp8, fp8_gemm
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.kernels.schedule import build_row_schedule
from megamoe.tools.bench_kernels import rows_padded


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=8)
    args = p.parse_args()
    dev = torch.device("cuda")
    for e, rows, h, i in ((32, 1024, 7168, 2048), (8, 384, 2880, 2880)):
        m = e * rows
        sched = build_row_schedule(torch.arange(m, device=dev)[:, None] // rows, e, 128)
        gen = torch.Generator(device=dev).manual_seed(0)

        def rnd(width: int) -> torch.Tensor:
            x = torch.randn(m, width, device=dev, generator=gen) * 0.05
            return rows_padded(x.to(torch.bfloat16), sched)

        a, b = fp8.quantize_cols(rnd(h)), fp8.quantize_cols(rnd(i))
        old = dict(fp8_gemm.GPU_TILES)
        fp8_gemm.GPU_TILES["wgrad"] = fp8_gemm.triton_tiles("wgrad", fp8_gemm.WARP_SPECIALIZED)
        ref = fp8_gemm.wgrad(*a, *b, sched)
        for stages in (3, 4):
            ws = dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, stages=stages)
            fp8_gemm.GPU_TILES["wgrad"] = ws
            off = []
            for _ in range(args.runs):
                with poisoned_buffers():
                    out = fp8_gemm.wgrad(*a, *b, sched)
                off.append(int((out.view(torch.int16) != ref.view(torch.int16)).sum()))
            print(f"{e} x {rows} rows, {h} x {i}, {stages} stages: elements off a run {off}")
        fp8_gemm.GPU_TILES.update(old)


if __name__ == "__main__":
    main()
