"""Probe (one GPU): h quantized in the gate/up epilogue (``fp8_gemm.gate_up_quantized`` on the
warp-specialized wide tiles) against gate/up writing bf16 h and ``fp8.quantize_rows_cols``'
pass over it (h's 1x128 quantization and the packed rows of h^T, as the fp8 forward used to
make them), on the presets and the model table.

    PYTHONPATH=. python benchmarks/probes/gate_up_quantize_h.py [--out probe.json]

Per shape (every expert ``tokens * top_k / E`` rows, as ``bench_kernels``): both variants
interleaved (``bench_kernels._interleaved_ms``), their outputs compared bitwise on the used
rows (g, u, hq and its scales, h^T's bytes and scales), median ms.
"""

import argparse
import json

import torch

from megamoe.kernels import fp8, fp8_gemm
from megamoe.kernels.schedule import build_row_schedule
from megamoe.tools.bench_kernels import _interleaved_ms, gemm_shapes


def _variants(e: int, rows: int, h: int, i: int):
    dev = torch.device("cuda")
    m = e * rows
    sched = build_row_schedule(torch.arange(m, device=dev)[:, None] // rows, e, 128)
    gen = torch.Generator(device=dev).manual_seed(0)
    real = (sched.row_src >= 0).to(torch.bfloat16)[:, None]
    x = torch.randn(sched.rows, h, device=dev, generator=gen).to(torch.bfloat16) * real
    xq = fp8.quantize_rows(x)
    wg, wu = (
        fp8.quantize_weight((torch.randn(e, i, h, device=dev, generator=gen) * 0.05).bfloat16())
        for _ in range(2)
    )
    rows16 = sched.rows + -sched.rows % 16

    def with_pass():
        g, u, hh = fp8_gemm.gate_up(*xq, wg, wu, sched)
        h_t = torch.empty((i, fp8.packed_width(rows16)), dtype=torch.int16, device=dev)
        hq, _ = fp8.quantize_rows_cols(hh, pad_to=16, cols_out=h_t)
        return g, u, hq, h_t

    def epilogue():
        return fp8_gemm.gate_up_quantized(*xq, wg, wu, sched)

    variants = {"gate/up + pass": with_pass, "epilogue": epilogue}
    return variants, int(sched.num_blocks.item()) * 128, rows16


def _same(a, b, used: int, rows16: int) -> bool:
    (g, u, (hq, hs), h_t), (g2, u2, (hq2, hs2), h_t2) = a, b
    (qt, st), (qt2, st2) = (fp8.unpack_rows(t, rows16) for t in (h_t, h_t2))
    return (
        all(
            torch.equal(p[:used].view(torch.uint8), q[:used].view(torch.uint8))
            for p, q in ((g, g2), (u, u2), (hq, hq2))
        )
        and torch.equal(hs[:used], hs2[:used])
        and torch.equal(qt[:, :used].view(torch.uint8), qt2[:, :used].view(torch.uint8))
        and torch.equal(st[:, : used // 128], st2[:, : used // 128])
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    groups = [(["dsv3", "qwen3-30b"], 4096), (["all"], 16384)]
    records = []
    for models, tokens in groups:
        for name, e, rows, h, i in gemm_shapes(models, tokens):
            try:
                fns, used, rows16 = _variants(e, rows, h, i)
                outs = {k: fn() for k, fn in fns.items()}
                same = _same(outs["gate/up + pass"], outs["epilogue"], used, rows16)
            except torch.OutOfMemoryError as exc:
                print(f"{name}: out of memory ({exc})")
                continue
            ms = _interleaved_ms(fns, args.iters)
            rec = dict(
                model=name, tokens=tokens, experts=e, rows_per_expert=rows, hidden=h,
                intermediate=i, gpu=torch.cuda.get_device_name(), same_bits=same,
                pass_ms=ms["gate/up + pass"], epilogue_ms=ms["epilogue"],
            )  # fmt: skip
            rec["speedup"] = rec["pass_ms"] / rec["epilogue_ms"]
            records.append(rec)
            print(
                f"{name:20s} {tokens:6d} tok  gate/up + pass {rec['pass_ms']:7.3f} ms  "
                f"epilogue {rec['epilogue_ms']:7.3f} ms  {rec['speedup']:.3f}x  same bits: {same}"
            )
            del fns, outs
            torch.cuda.empty_cache()
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
