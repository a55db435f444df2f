"""Probe (one GPU): the fp8 layer's quantizer passes as the layer calls them, their time, bytes
per second and a digest of their outputs, so that two trees (a change to a quantizer's
arithmetic) can be timed back to back and checked for the same bits.

    PYTHONPATH=. python benchmarks/probes/quantizers.py [--models ...] [--tokens N] [--out X]

Per model (every expert ``tokens * top_k / E`` rows, as ``bench_kernels``; the presets' local
experts): ``quantize_packed`` of the tokens' x (1x128, the dispatch's packed rows),
``requantize_cols`` of the routed rows' packed x (the gate/up weight gradients' 128x1 x^T),
the pass over d_g and d_u (``fp8_gemm._rows_cols_of``: both layouts), and ``quantize_weight``
of gate or up and of down (both layouts). Interleaved rounds (``bench_kernels.
_interleaved_ms``), median ms, GB/s of bytes read + written, SHA-256 of the outputs' bytes.
"""

import argparse
import hashlib
import json

import torch

from megamoe.kernels import fp8, fp8_gemm
from megamoe.tools.bench_kernels import _interleaved_ms, gemm_shapes

DEV = torch.device("cuda")


def _digest(out) -> str:
    """SHA-256 of every tensor's bytes in ``out`` (nested tuples, lists, Fp8Weight)."""
    h = hashlib.sha256()

    def walk(v):
        if isinstance(v, torch.Tensor):
            h.update(v.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        elif isinstance(v, (tuple, list)):
            for t in v:
                walk(t)

    walk(out)
    return h.hexdigest()[:16]


def _passes(e: int, rows: int, h: int, i: int, tokens: int) -> dict:
    """name -> (call, bytes read + written) of the layer's quantizer passes at one shape."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(tokens, h, device=DEV, generator=gen).bfloat16()
    m = e * rows
    gathered = fp8.quantize_packed(torch.randn(m, h, device=DEV, generator=gen).bfloat16())
    both = torch.randn(2, m, i, device=DEV, generator=gen).bfloat16()
    w_up = torch.randn(e, i, h, device=DEV, generator=gen).bfloat16()
    w_down = torch.randn(e, h, i, device=DEV, generator=gen).bfloat16()
    return {
        "x 1x128 (packed)": (lambda: fp8.quantize_packed(x), 3 * x.numel()),
        "x^T 128x1 (requantize)": (
            lambda: fp8.requantize_cols(*fp8.unpack_rows(gathered, h)),
            2 * m * h,
        ),
        "d_g, d_u both ways": (lambda: fp8_gemm._rows_cols_of(both), 4 * both.numel()),
        "gate or up weight": (lambda: fp8.quantize_weight(w_up, transposed=True), 4 * w_up.numel()),
        "down weight": (lambda: fp8.quantize_weight(w_down, transposed=True), 4 * w_down.numel()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["dsv3", "qwen3-30b", "glm-4.5"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--label", default="", help="recorded with each row (e.g. the tree)")
    parser.add_argument("--out")
    args = parser.parse_args()
    records = []
    for name, e, rows, h, i in gemm_shapes(args.models, args.tokens):
        passes = _passes(e, rows, h, i, args.tokens)
        digests = {k: _digest(fn()) for k, (fn, _) in passes.items()}
        ms = _interleaved_ms({k: fn for k, (fn, _) in passes.items()}, args.iters)
        for k, (_, nbytes) in passes.items():
            rec = dict(label=args.label, model=name, experts=e, rows=rows, hidden=h)
            rec.update(intermediate=i, tokens=args.tokens, kernel=k, ms=ms[k])
            rec.update(gb_per_s=nbytes / ms[k] / 1e6, digest=digests[k])
            records.append(rec)
            print(f"{args.label:6s} {name:10s} {k:24s} {ms[k]:7.3f} ms {rec['gb_per_s']:6.0f} GB/s"
                  f"  {digests[k]}")  # fmt: skip
        del passes
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), records=records), f, indent=1)


if __name__ == "__main__":
    main()
