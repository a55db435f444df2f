"""Probe (one GPU): activations quantized in the epilogue of the GEMM that makes them, against
that GEMM writing them in bf16 and ``fp8.quantize_rows_cols``' pass over them, on the presets
and the model table:

  * ``h``: h in the gate/up epilogue (``fp8_gemm.gate_up_quantized`` on the warp-specialized
    wide tiles) against gate/up writing h and the pass (h's 1x128 quantization and the packed
    rows of h^T, as the fp8 forward used to make them);
  * ``dgdu``: d_g and d_u in the SwiGLU backward's epilogue (``fp8_gemm.
    dgrad_swiglu_quantized`` on the warp-specialized kernel with ``fp8_gemm.
    EPILOGUE_QUANTIZES["dgdu"]``) against ``dgrad_swiglu`` into one
    [2, rows, I] buffer and one pass over both (as the fp8 backward used to make them).

    PYTHONPATH=. python benchmarks/probes/epilogue_quantization.py [--which h dgdu] [--out X]

Per shape (every expert ``tokens * top_k / E`` rows, as ``bench_kernels``): both variants
interleaved (``bench_kernels._interleaved_ms``), their quantized outputs compared bitwise on the
used rows (bytes and scales of both layouts; gate/up's g and u too), median ms.
"""

import argparse
import json

import torch

from megamoe.kernels import fp8, fp8_gemm
from megamoe.kernels.schedule import build_row_schedule
from megamoe.tools.bench_kernels import _interleaved_ms, gemm_shapes

DEV = torch.device("cuda")


def _operands(e: int, rows: int, k: int):
    """A balanced schedule of ``rows`` rows an expert, its bf16 rows [rows, k] (zeros in
    padding rows) quantized 1x128, and a generator for the rest."""
    m = e * rows
    sched = build_row_schedule(torch.arange(m, device=DEV)[:, None] // rows, e, 128)
    gen = torch.Generator(device=DEV).manual_seed(0)
    real = (sched.row_src >= 0).to(torch.bfloat16)[:, None]
    a = torch.randn(sched.rows, k, device=DEV, generator=gen).to(torch.bfloat16) * real
    return sched, fp8.quantize_rows(a), gen


def _weight(gen, e: int, n: int, k: int, transposed: bool = False) -> fp8.Fp8Weight:
    w = torch.randn(e, n, k, device=DEV, generator=gen) * 0.05
    return fp8.quantize_weight(w.bfloat16(), transposed=transposed)


def _h_variants(e: int, rows: int, h: int, i: int):
    """h's two variants, each returning ([bf16 outputs], [quantizations])."""
    sched, xq, gen = _operands(e, rows, h)
    wg, wu = _weight(gen, e, i, h), _weight(gen, e, i, h)
    rows16 = sched.rows + -sched.rows % 16

    def with_pass():
        g, u, hh = fp8_gemm.gate_up(*xq, wg, wu, sched)
        h_t = torch.empty((i, fp8.packed_width(rows16)), dtype=torch.int16, device=DEV)
        hq, _ = fp8.quantize_rows_cols(hh, pad_to=16, cols_out=h_t)
        return [g, u], [(hq, fp8.unpack_rows(h_t, rows16))]

    def epilogue():
        g, u, hq, h_t = fp8_gemm.gate_up_quantized(*xq, wg, wu, sched)
        return [g, u], [(hq, fp8.unpack_rows(h_t, rows16))]

    return sched, {"gate/up + pass": with_pass, "epilogue": epilogue}


def _dgdu_variants(e: int, rows: int, h: int, i: int):
    """d_g's and d_u's two variants, each returning ([], [quantizations])."""
    sched, dzq, gen = _operands(e, rows, h)
    w_down = _weight(gen, e, h, i, transposed=True)
    g, u = (torch.randn(sched.rows, i, device=DEV, generator=gen).bfloat16() for _ in range(2))
    m = sched.rows

    def with_pass():
        both = torch.empty((2, m, i), dtype=torch.bfloat16, device=DEV)
        fp8_gemm.dgrad_swiglu(*dzq, w_down, g, u, sched, out=both)
        return [], fp8_gemm._rows_cols_of(both)  # (the pass the layer ran)

    def epilogue():
        fp8_gemm.EPILOGUE_QUANTIZES["dgdu"] = True
        try:
            return [], list(fp8_gemm.dgrad_swiglu_quantized(*dzq, w_down, g, u, sched))
        finally:
            fp8_gemm.EPILOGUE_QUANTIZES["dgdu"] = False

    return sched, {"gemm + pass": with_pass, "epilogue": epilogue}


def _same(a, b, used: int) -> bool:
    """Bitwise equal on the used rows: the bf16 outputs and each quantization's bytes and
    scales in both layouts."""
    (plain, quants), (plain2, quants2) = a, b
    bits = lambda t: t.view(torch.uint8) if t.dtype == fp8.FP8 else t  # noqa: E731
    same = all(torch.equal(p[:used], q[:used]) for p, q in zip(plain, plain2))
    for ((q, s), (q_t, s_t)), ((q2, s2), (q_t2, s_t2)) in zip(quants, quants2):
        same &= torch.equal(bits(q[:used]), bits(q2[:used])) and torch.equal(s[:used], s2[:used])
        same &= torch.equal(bits(q_t[:, :used]), bits(q_t2[:, :used]))
        same &= torch.equal(s_t[:, : used // 128], s_t2[:, : used // 128])
    return same


VARIANTS = {"h": _h_variants, "dgdu": _dgdu_variants}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--which", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    parser.add_argument("--out")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    groups = [(["dsv3", "qwen3-30b"], 4096), (["all"], 16384)]
    records = []
    for which in args.which:
        for models, tokens in groups:
            for name, e, rows, h, i in gemm_shapes(models, tokens):
                try:
                    sched, fns = VARIANTS[which](e, rows, h, i)
                    used = int(sched.num_blocks.item()) * 128
                    outs = [fn() for fn in fns.values()]
                    same = _same(*outs, used)
                    del outs
                    ms = _interleaved_ms(fns, args.iters)
                except torch.OutOfMemoryError as exc:
                    print(f"{which} {name}: out of memory ({exc})")
                    torch.cuda.empty_cache()
                    continue
                base, epi = ms.keys()
                rec = dict(
                    which=which, model=name, tokens=tokens, experts=e, rows_per_expert=rows,
                    hidden=h, intermediate=i, gpu=torch.cuda.get_device_name(), same_bits=same,
                    pass_ms=ms[base], epilogue_ms=ms[epi],
                )  # fmt: skip
                rec["speedup"] = rec["pass_ms"] / rec["epilogue_ms"]
                records.append(rec)
                print(
                    f"{which:4s} {name:20s} {tokens:6d} tok  {base} {rec['pass_ms']:7.3f} ms  "
                    f"epilogue {rec['epilogue_ms']:7.3f} ms  {rec['speedup']:.3f}x  "
                    f"same bits: {same}",
                    flush=True,
                )
                del fns
                torch.cuda.empty_cache()
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
