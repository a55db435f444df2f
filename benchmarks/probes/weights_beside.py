"""Probe (one GPU): the fp8 weights' quantization of every step beside the forward's gate/up
GEMM, on a few SMs of a second stream, against quantizing them first on the whole GPU.

    PYTHONPATH=. python benchmarks/probes/weights_beside.py [--models ...] [--out X]

Per shape (every expert ``tokens * top_k / E`` rows, as ``bench_kernels``), interleaved
(``bench_kernels._interleaved_ms``), median ms of:

  * ``first``: gate and up, then down quantized (``fp8.quantize_weight(...,
    transposed=True)``, one program a block), then ``fp8_gemm.gate_up_quantized`` on every SM:
    what the layer's forward runs today up to its down GEMM;
  * ``beside P``: gate and up quantized on the whole GPU, then down quantized by P persistent
    programs on a second stream while gate/up runs on the other SMs (``programs=SMs - P``),
    joined before the end;
  * each part alone: down quantized by P programs (its GB/s: P SMs' bandwidth) and gate/up on
    SMs - P programs.

Every variant's fp8 weights are compared bitwise with ``first``'s.
"""

import argparse
import json

import torch

from megamoe.kernels import fp8, fp8_gemm
from megamoe.kernels.runtime import persistent_programs
from megamoe.kernels.schedule import build_row_schedule
from megamoe.tools.bench_kernels import _interleaved_ms, gemm_shapes

DEV = torch.device("cuda")
PROGRAMS = (8, 16, 24, 32)


def _case(e: int, rows: int, h: int, i: int):
    m = e * rows
    sched = build_row_schedule(torch.arange(m, device=DEV)[:, None] // rows, e, 128)
    gen = torch.Generator(device=DEV).manual_seed(0)
    real = (sched.row_src >= 0).to(torch.bfloat16)[:, None]
    a = torch.randn(sched.rows, h, device=DEV, generator=gen).to(torch.bfloat16) * real
    xq = fp8.quantize_rows(a)
    ws = [
        (torch.randn(shape, device=DEV, generator=gen) * 0.05).bfloat16()
        for shape in ((e, i, h), (e, i, h), (e, h, i))
    ]
    return sched, xq, ws


def _measure(name, e, rows, h, i, sms, side, iters) -> list[dict]:
    """The variants of one shape, interleaved (the module's docstring)."""
    records = []
    sched, xq, (wg, wu, wd) = _case(e, rows, h, i)
    g8c, u8c = (fp8.quantize_weight(w) for w in (wg, wu))
    out = {}

    def first():
        g8, u8 = (fp8.quantize_weight(w, transposed=True) for w in (wg, wu))
        d8 = fp8.quantize_weight(wd, transposed=True)
        fp8_gemm.gate_up_quantized(*xq, g8, u8, sched)
        out["first"] = d8

    def beside(p):
        def run():
            g8, u8 = (fp8.quantize_weight(w, transposed=True) for w in (wg, wu))
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                d8 = fp8.quantize_weight(wd, transposed=True, programs=p)
            fp8_gemm.gate_up_quantized(*xq, g8, u8, sched, programs=sms - p)
            main.wait_stream(side)
            out[f"beside {p}"] = d8

        return run

    fns = {"first": first}
    for p in PROGRAMS:
        fns[f"beside {p}"] = beside(p)
        fns[f"down quantized by {p}"] = lambda p=p: fp8.quantize_weight(
            wd, transposed=True, programs=p
        )
        fns[f"gate/up on {sms - p}"] = lambda p=p: fp8_gemm.gate_up_quantized(
            *xq, g8c, u8c, sched, programs=sms - p
        )
    fns["down quantized, whole GPU"] = lambda: fp8.quantize_weight(wd, transposed=True)
    fns[f"gate/up on {sms}"] = lambda: fp8_gemm.gate_up_quantized(*xq, g8c, u8c, sched)
    for fn in list(fns.values())[:1] + [fns[f"beside {p}"] for p in PROGRAMS]:
        fn()
    torch.cuda.synchronize()
    same = {
        k: all(
            torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            for x, y in zip(out[k], out["first"])
        )
        for k in out
    }
    ms = _interleaved_ms(fns, iters)
    down_bytes = 4 * wd.numel()
    for k, v in ms.items():
        rec = dict(model=name, experts=e, rows=rows, hidden=h, intermediate=i, variant=k)
        rec["ms"] = v
        if isinstance(v, float):
            rec["ratio_to_first"] = ms["first"] / v
            if k.startswith("down quantized"):
                rec["gb_per_s"] = down_bytes / v / 1e6
        rec["same_bits"] = same.get(k)
        records.append(rec)
        extra = f"  {rec['gb_per_s']:6.0f} GB/s" if "gb_per_s" in rec else ""
        ratio = f"  first / this {rec['ratio_to_first']:.3f}" if "ratio_to_first" in rec else ""
        print(f"{name:14s} {k:28s} {v:8.3f} ms{ratio}{extra}  same bits: {same.get(k)}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["dsv3", "qwen3-30b", "glm-4.5"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    sms = persistent_programs(DEV)
    side = torch.cuda.Stream(DEV)
    records = []
    for shape in gemm_shapes(args.models, args.tokens):
        records += _measure(*shape, sms, side, args.iters)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), sms=sms, records=records), f,
                          indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
