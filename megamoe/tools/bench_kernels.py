"""Benchmark of the Triton grouped GEMMs alone (and the whole triton layer) on one GPU.

``bench_grouped_gemm`` times our six grouped GEMMs (forward gate/up and down, the two dgrads,
the two wgrads) against ``torch._grouped_mm`` doing the same products, at the MoE layer of each
model of the shape table (``megamoe.shapes.MODEL_SHAPES``, W = 1) or of the presets: ``tokens``
tokens routed top-k, every expert the same whole number of rows (a multiple of 16, as
``torch._grouped_mm``'s offsets want; ours pads each expert to its 128-row blocks, and that
cost is in its time). Gate and up are one stacked ``[E, 2I, H]`` weight, read in place by both.
The implementations of a kernel are timed in turn, ``ROUNDS`` rounds of ``iters`` iterations
each (so a drift of the GPU's clock hits them alike); the median of the per-iteration CUDA-event
times, one record per (shape, kernel, implementation) with the ratio to torch from the same run
(``vs_torch``). Our dgrad of down also runs the SwiGLU backward in its epilogue (it reads g and
u and writes d_g and d_u): beside torch's GEMM alone, ``torch._grouped_mm+swiglu`` times the
GEMM followed by the SwiGLU backward as eager torch ops (``aten.silu_backward`` and two
products, what autograd of ``silu(g) * u`` runs), and our record's ``vs_torch_swiglu`` is the
ratio to that.

With ``precision="fp8"`` (``--precision fp8``) the block-scaled fp8 kernels (``triton-fp8``)
join them, on operands quantized before the timing (1x128 rows, 128x1 columns for the weight
gradients, 128x128 weights): the GEMMs alone, their quantizers not counted. For gate/up and
down two dense cuBLAS anchors of the same product size come with them: ``cublas-bf16``
(``torch.mm``) and ``cublas-fp8-rowwise`` (``torch._scaled_mm`` with one scale per row and
column), the rates a grouped kernel is measured against.

``python -m megamoe.tools.bench_kernels --model all --out results.json`` prints a table and
writes the records.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Callable

import torch

from ..kernels.schedule import RowSchedule
from ..shapes import MODEL_SHAPES, PRESETS, get_preset
from ..types import ExpertWeights

__all__ = [
    "bench_grouped_gemm",
    "bench_layer",
    "gemm_shapes",
    "kernel_calls",
    "event_times_ms",
    "KERNELS",
]

KERNELS = ("gate_up", "down", "dgrad_swiglu", "dgrad_pair", "wgrad_down", "wgrad_gate_up")
_WARMUP = 5
ROUNDS = 3
TORCH, TORCH_SWIGLU = "torch._grouped_mm", "torch._grouped_mm+swiglu"


def event_times_ms(fn: Callable[[], object], iters: int) -> list[float]:
    """The CUDA-event time of each of ``iters`` calls, back to back (no warm-up)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _interleaved_ms(fns: dict[str, Callable[[], object]], iters: int) -> dict[str, float | str]:
    """Each function's median CUDA-event time over ``ROUNDS`` rounds of ``iters`` calls, the
    functions in turn within a round, after a warm-up; a function that raises gets its error
    (one failing variant hides no other)."""
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    for name, fn in fns.items():
        try:
            for _ in range(_WARMUP):
                fn()
            times[name] = []
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
    for _ in range(ROUNDS):
        for name in times:
            times[name] += event_times_ms(fns[name], iters)
    return {**{n: statistics.median(t) for n, t in times.items()}, **errors}


def _balanced_ids(tokens: int, experts: int, top_k: int, device: torch.device) -> torch.Tensor:
    """Token t goes to experts t*K .. t*K+K-1 (mod E): distinct, and every expert equally loaded."""
    t = torch.arange(tokens, device=device)[:, None] * top_k + torch.arange(top_k, device=device)
    return (t % experts).to(torch.int64)


def _gpu_name() -> str:
    return torch.cuda.get_device_name()


def gemm_shapes(models: list[str], tokens: int) -> list[tuple[str, int, int, int, int]]:
    """(name, experts, rows per expert, hidden, intermediate) of each model's routed experts at
    W = 1 with ``tokens`` tokens: ``tokens * top_k / experts`` rows each, rounded to 16 (at
    least 16). ``models``: names of the shape table, "all", or presets (their local experts)."""
    names = list(MODEL_SHAPES) if models == ["all"] else models
    shapes = []
    for name in names:
        if name in MODEL_SHAPES:
            m = MODEL_SHAPES[name]
            e, k, h, i = m.num_experts, m.top_k, m.hidden_size, m.intermediate_size
        else:
            p = get_preset(name)
            e, k, h, i = p.local_experts, p.top_k, p.hidden_size, p.intermediate_size
        rows = max(16, round(tokens * k / e / 16) * 16)
        shapes.append((name, e, rows, h, i))
    return shapes


def _flops(kind: str, m: int, h: int, i: int) -> int:
    """Useful FLOPs of one kernel over m rows (gate/up kernels do two products of I x H)."""
    return 2 * m * h * i * (2 if kind in ("gate_up", "dgrad_pair", "wgrad_gate_up") else 1)


def bench_grouped_gemm(
    models: list[str] | None = None,
    tokens: int = 4096,
    iters: int = 20,
    precisions: tuple[str, ...] = ("bf16",),
) -> list[dict]:
    """TFLOP/s of our grouped GEMMs and of ``torch._grouped_mm`` on the same products (see the
    module docstring); ``models`` default: the presets; ``precisions``: "bf16" and/or "fp8"."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    records = []
    for shape in gemm_shapes(models or ["dsv3", "qwen3-30b", "mok-v4"], tokens):
        base = dict(shape=shape[0], tokens=tokens, gpu=_gpu_name(), date=date)
        records += _bench_shape(*shape[1:], iters, base, precisions)
        torch.cuda.empty_cache()  # (one shape's tensors at a time)
    return records


def kernel_calls(
    e: int, rows: int, h: int, i: int, precisions=("bf16",)
) -> tuple[dict[str, dict[str, Callable]], RowSchedule]:
    """``{impl: {kernel: call}}`` at one shape (``e`` experts of ``rows`` rows each): ours in
    each precision ("triton", "triton-fp8"), ``torch._grouped_mm`` where torch has it, and with
    fp8 the dense cuBLAS anchors; the operands are made (and quantized) here, once. Also the
    row schedule of our padded layout (past its used rows the outputs hold garbage)."""
    from ..kernels import gemm
    from ..kernels.schedule import build_row_schedule

    dev = torch.device("cuda")
    m = e * rows
    # one row per token, token t in expert t // rows: every expert exactly `rows` rows
    sched = build_row_schedule(torch.arange(m, device=dev)[:, None] // rows, e, 128)
    offs = (torch.arange(1, e + 1, device=dev) * rows).to(torch.int32)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, device=dev, generator=gen) * 0.05).to(torch.bfloat16)

    # (our row layout pads every expert to 128-row blocks; torch's rows are packed)
    x, hh, dz, g, u = rnd(m, h), rnd(m, i), rnd(m, h), rnd(m, i), rnd(m, i)
    xp, hp, dzp, gp, up = (rows_padded(t, sched) for t in (x, hh, dz, g, u))
    stacked, w_down = rnd(e, 2 * i, h), rnd(e, h, i)
    w = ExpertWeights.from_gate_up(stacked, w_down).split_gate_up()  # views of the halves
    gu = torch.cat([g, u], dim=1)
    calls: dict[str, dict[str, Callable]] = {}
    if "bf16" in precisions:
        calls["triton"] = {
            "gate_up": lambda: gemm.gate_up(xp, w.w_gate, w.w_up, sched),
            "down": lambda: gemm.grouped_mm(hp, w_down, sched),
            "dgrad_swiglu": lambda: gemm.dgrad_swiglu(dzp, w_down, gp, up, sched),
            "dgrad_pair": lambda: gemm.dgrad_pair(gp, w.w_gate, up, w.w_up, sched),
            "wgrad_down": lambda: gemm.wgrad(dzp, hp, sched),
            "wgrad_gate_up": lambda: (gemm.wgrad(gp, xp, sched), gemm.wgrad(up, xp, sched)),
        }
    if "fp8" in precisions:
        calls["triton-fp8"] = _fp8_kernels(xp, hp, dzp, gp, up, w, w_down, sched)
    if hasattr(torch, "_grouped_mm"):
        # the same products on packed rows
        calls[TORCH] = {
            "gate_up": lambda: torch._grouped_mm(x, stacked.transpose(1, 2), offs=offs),
            "down": lambda: torch._grouped_mm(hh, w_down.transpose(1, 2), offs=offs),
            "dgrad_swiglu": lambda: torch._grouped_mm(dz, w_down, offs=offs),
            "dgrad_pair": lambda: torch._grouped_mm(gu, stacked, offs=offs),
            "wgrad_down": lambda: torch._grouped_mm(dz.t(), hh, offs=offs),
            "wgrad_gate_up": lambda: torch._grouped_mm(gu.t(), x, offs=offs),
        }

        def dgrad_swiglu_eager() -> tuple[torch.Tensor, torch.Tensor]:
            dh = torch._grouped_mm(dz, w_down, offs=offs)
            return torch.ops.aten.silu_backward(dh * u, g), dh * torch.nn.functional.silu(g)

        calls[TORCH_SWIGLU] = {"dgrad_swiglu": dgrad_swiglu_eager}
    if "fp8" in precisions:
        for kind, anchors in _dense_anchors(x, hh, stacked, w_down).items():
            for impl, fn in anchors.items():
                calls.setdefault(impl, {})[kind] = fn
    return calls, sched


def _bench_shape(
    e: int, rows: int, h: int, i: int, iters: int, base: dict, precisions=("bf16",)
) -> list[dict]:
    m = e * rows
    calls, _ = kernel_calls(e, rows, h, i, precisions)
    records = []
    for kind in KERNELS:
        fns = {impl: kernel_fns[kind] for impl, kernel_fns in calls.items() if kind in kernel_fns}
        recs = {}
        for impl, got in _interleaved_ms(fns, iters).items():
            rec = dict(base, kernel=kind, impl=impl, experts=e, rows_per_expert=rows)
            rec.update(hidden=h, intermediate=i, precision="fp8" if "fp8" in impl else "bf16")
            if isinstance(got, str):
                rec.update(error=got)
            else:
                rec.update(ms=got, tflops=_flops(kind, m, h, i) / got / 1e9)
            recs[impl] = rec
        for r in recs.values():
            if "ms" not in r or r["impl"].startswith(TORCH):
                continue
            for impl, key in ((TORCH, "vs_torch"), (TORCH_SWIGLU, "vs_torch_swiglu")):
                if "ms" in recs.get(impl, {}):
                    r[key] = recs[impl]["ms"] / r["ms"]
        records += recs.values()
    return records


def _fp8_kernels(xp, hp, dzp, gp, up, w: ExpertWeights, w_down, sched) -> dict[str, Callable]:
    """The fp8 kernels of each GEMM on operands quantized here (the timing sees the GEMMs)."""
    from ..kernels import fp8, fp8_gemm

    xq, hq, dzq, gq, uq = (fp8.quantize_rows(t) for t in (xp, hp, dzp, gp, up))
    xc, hc, dzc, gc, uc = (fp8.quantize_cols(t) for t in (xp, hp, dzp, gp, up))
    wg, wu, wd = (fp8.quantize_weight(t, transposed=True) for t in (w.w_gate, w.w_up, w_down))
    return {
        "gate_up": lambda: fp8_gemm.gate_up(*xq, wg, wu, sched),
        "down": lambda: fp8_gemm.grouped_mm(*hq, wd, sched),
        "dgrad_swiglu": lambda: fp8_gemm.dgrad_swiglu(*dzq, wd, gp, up, sched),
        "dgrad_pair": lambda: fp8_gemm.dgrad_pair(*gq, wg, *uq, wu, sched),
        "wgrad_down": lambda: fp8_gemm.wgrad(*dzc, *hc, sched),
        "wgrad_gate_up": lambda: (fp8_gemm.wgrad(*gc, *xc, sched), fp8_gemm.wgrad(*uc, *xc, sched)),
    }


def _dense_anchors(x, hh, stacked, w_down) -> dict[str, dict[str, Callable]]:
    """cuBLAS on one dense product of the grouped one's size (all rows times one expert's
    weight): bf16 ``torch.mm`` and rowwise-scaled fp8 ``torch._scaled_mm``, for gate/up and
    down."""
    fp8 = torch.float8_e4m3fn

    def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        return (t.float() / scale).to(fp8), scale

    out = {}
    for kind, a, wt in (("gate_up", x, stacked[0]), ("down", hh, w_down[0])):
        (aq, a_s), (bq, b_s) = rowwise(a), rowwise(wt)
        bt = wt.t()
        out[kind] = {
            "cublas-bf16": lambda a=a, bt=bt: torch.mm(a, bt),
            "cublas-fp8-rowwise": lambda aq=aq, a_s=a_s, bq=bq, b_s=b_s: torch._scaled_mm(
                aq, bq.t(), scale_a=a_s, scale_b=b_s.t(), out_dtype=torch.bfloat16
            ),
        }
    return out


def rows_padded(t: torch.Tensor, sched) -> torch.Tensor:
    """``t``'s rows (expert-sorted, packed) in the schedule's padded row layout (zeros between)."""
    from ..kernels import rows as row_kernels

    return row_kernels.gather(t, sched)


def bench_layer(preset: str = "dsv3", iters: int = 20) -> dict:
    """Forward and forward+backward of backend "triton" at a preset (W = 1, balanced routing)."""
    from ..backends import triton as backend

    p = get_preset(preset)
    cfg = p.config(1)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(shape, device=dev, generator=gen) * scale).to(torch.bfloat16)

    t, h, i, e, i_s = (
        p.tokens_per_rank,
        p.hidden_size,
        p.intermediate_size,
        p.local_experts,
        p.shared_intermediate_size,
    )
    ids = _balanced_ids(t, e, p.top_k, dev)
    w = torch.softmax(torch.randn((t, p.top_k), device=dev, generator=gen), dim=1)
    shared = (rnd(i_s, h), rnd(i_s, h), rnd(h, i_s)) if i_s else (None, None, None)
    weights = ExpertWeights(rnd(e, i, h), rnd(e, i, h), rnd(e, h, i), *shared)
    x, dy = rnd(t, h, scale=1.0), rnd(t, h, scale=1.0)

    def fwd():
        sched = backend.build_schedule(ids, cfg, None)
        return backend.forward(x, ids, w, weights, cfg, None, sched)

    def fwd_bwd():
        _, ctx = fwd()
        return backend.backward(ctx, dy)

    times = _interleaved_ms({"fwd": fwd, "fwd_bwd": fwd_bwd}, iters)
    fwd_ms, fwdbwd_ms = times["fwd"], times["fwd_bwd"]
    flops = cfg.flops_per_token() * t
    return dict(
        preset=preset,
        world_size=1,
        backend="triton",
        gpu=_gpu_name(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        tokens_per_rank=t,
        hidden=h,
        intermediate=i,
        experts=e,
        top_k=p.top_k,
        shared_intermediate=i_s,
        fwd_ms=fwd_ms,
        fwdbwd_ms=fwdbwd_ms,
        bwd_ms=fwdbwd_ms - fwd_ms,
        fwd_tflops=flops / fwd_ms / 1e9,
        fwdbwd_tflops=3 * flops / fwdbwd_ms / 1e9,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Triton grouped-GEMM benchmark (one GPU)")
    parser.add_argument("--out", help="write the records as JSON here")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--model",
        nargs="+",
        default=["dsv3", "qwen3-30b", "mok-v4"],
        help="models of the shape table, 'all', or presets (default: the presets)",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="tokens routed (W = 1)")
    parser.add_argument("--layer", nargs="*", default=[], help="also time the layer at presets")
    parser.add_argument(
        "--precision",
        nargs="+",
        choices=["bf16", "fp8"],
        default=["bf16"],
        help="our kernels in bf16 and/or fp8 (fp8 adds the cuBLAS anchors; default bf16)",
    )
    args = parser.parse_args(argv)
    for m in args.model:
        if m != "all" and m not in MODEL_SHAPES and m not in PRESETS:
            parser.error(
                f"--model {m!r} is neither a model of the shape table ({', '.join(MODEL_SHAPES)}) "
                f"nor a preset ({', '.join(PRESETS)}), nor 'all'"
            )
    records = bench_grouped_gemm(args.model, args.tokens, args.iters, tuple(args.precision))
    print(
        f"{'shape':22s} {'kernel':14s} {'impl':24s} {'ms':>8s} {'TFLOP/s':>8s} {'vs torch':>8s}"
        f" {'vs torch+swiglu':>15s}"
    )
    for r in records:
        head = f"{r['shape']:22s} {r['kernel']:14s} {r['impl']:24s}"
        if "error" in r:
            print(f"{head} ERROR {r['error'][:80]}")
        else:
            ratios = [f"{r[k]:7.2f}x" if k in r else "" for k in ("vs_torch", "vs_torch_swiglu")]
            print(f"{head} {r['ms']:8.3f} {r['tflops']:8.1f} {ratios[0]:>8s} {ratios[1]:>15s}")
    for preset in args.layer:
        rec = bench_layer(preset)
        records.append(rec)
        print(
            f"layer {preset}: fwd {rec['fwd_ms']:.2f} ms ({rec['fwd_tflops']:.0f} TFLOP/s), "
            f"fwd+bwd {rec['fwdbwd_ms']:.2f} ms ({rec['fwdbwd_tflops']:.0f} TFLOP/s)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
