"""Hardware counters of the fp8 GEMMs at one shape (default dsv3's preset: 32 experts of 1024
rows, H 7168, I 2048): each kernel compiled and run once, then run once more between
cudaProfilerStart/Stop for ``ncu --profile-from-start off``. Variants: the defaults, and with
``--ws-wgrad`` / ``--ws-swiglu`` the warp-specialized weight gradient / SwiGLU backward too.

  ncu --clock-control none --profile-from-start off --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats \
      python benchmarks/probes/ncu_fp8_gemms.py
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megamoe.kernels import fp8_gemm
from megamoe.tools.bench_kernels import kernel_calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=[32, 1024, 7168, 2048])
    p.add_argument(
        "--kernels",
        nargs="+",
        default=["gate_up", "down", "dgrad_pair", "dgrad_swiglu", "wgrad_down"],
    )
    p.add_argument("--ws-wgrad", action="store_true")
    args = p.parse_args()
    calls, _ = kernel_calls(*args.shape, precisions=("fp8",))
    fp8c = calls["triton-fp8"]
    runs = [(k, fp8c[k], None) for k in args.kernels]
    if args.ws_wgrad:
        ws = dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, group_m=1)
        runs.append(("wgrad_down_ws", fp8c["wgrad_down"], ("wgrad", ws)))

    def run(fn, tiles):
        old = dict(fp8_gemm.GPU_TILES)
        if tiles:
            for k in fp8_gemm.GPU_TILES:
                if k.startswith(tiles[0]):
                    fp8_gemm.GPU_TILES[k] = tiles[1]
        try:
            fn()
        finally:
            fp8_gemm.GPU_TILES.update(old)

    for _, fn, tiles in runs:
        run(fn, tiles)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn, tiles in runs:
        torch.cuda.nvtx.range_push(name)
        run(fn, tiles)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", [r[0] for r in runs])


if __name__ == "__main__":
    main()
