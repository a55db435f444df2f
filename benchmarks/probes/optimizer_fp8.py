"""Probe (one GPU): a training step of the layer with its optimizer, bf16 against fp8, where the
fp8 weight copies are written by a pass of their own in the forward or by the optimizer's
update (``megamoe.optim.AdamW(fp8_views=...)``).

    PYTHONPATH=. python benchmarks/probes/optimizer_fp8.py [--models dsv3 qwen3-30b]
        [--tokens N] [--iters 5] [--rounds 3] [--out probe.json]

One set of bf16 expert weights (W = 1, all of a model's experts), read by a bf16 and a fp8
``MoE`` of backend "triton". Variants, in turn within each round (interleaved), each run as
one untimed step and ``iters`` timed steps (zero_grad, forward, backward, optimizer step):

  bf16+torch      bf16 layer, ``torch.optim.AdamW(fused=True)``
  bf16+megamoe    bf16 layer, ``megamoe.optim.AdamW`` without copies (its update's own speed)
  fp8+torch       fp8 layer, torch's fused AdamW: the forward after each step quantizes
  fp8+plain       fp8 layer, ``megamoe.optim.AdamW`` without copies: the forward quantizes
  fp8+megamoe     fp8 layer, ``megamoe.optim.AdamW`` writing the copies: the forward reads them
  fp8+reread      as fp8+megamoe, its update reading each new block back (``--reread-parts``:
                  rows a part, warps)

Per variant the medians of the step, of forward + backward and of the optimizer step (CUDA
events between them), and for fp8+megamoe the weight quantizations its forwards made (0, or the
copies were not read). ``layer_ms`` is the issue's measure, the layer's forward + backward with
the weights' quantization of a step: forward + backward, plus for fp8+megamoe and fp8+reread
what its update costs over megamoe's update without copies. Ratios are bf16+torch's time over
each.

``--kernels`` first times the updates alone on each model's gate weight ([E, I, H] bf16, moments
bf16): torch's fused AdamW, megamoe's plain update, its update writing the copies at several
(rows a part, warps, the new block kept in registers or read back) of ``kernels.adamw`` (the
default first; every one must give the default's bits), and ``fp8.quantize_weight`` with the
transposed copy (the pass the copies replace).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

import megamoe
from megamoe import optim
from megamoe.backends import fp8_weights
from megamoe.kernels import adamw, fp8
from megamoe.shapes import get_model_shape, get_preset
from megamoe.tools.bench_kernels import event_times_ms

VARIANTS = ("bf16+torch", "bf16+megamoe", "fp8+torch", "fp8+plain", "fp8+megamoe", "fp8+reread")
# (rows a part, warps, the new block read back) of the update writing the copies; the default
# first
PARTS = [
    (adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD),
    (32, 16, False),
    *((rows, warps, True) for rows, warps in ((8, 4), (8, 8), (16, 4), (16, 8), (16, 16), (32, 8))),
]
PARTS = list(dict.fromkeys(PARTS))


def _kernels(name: str, tokens: int | None, rounds: int) -> dict:
    """The updates alone on the model's gate weight (module docstring)."""
    cfg, _ = _config(name, tokens)
    dev = torch.device("cuda")
    shape = (cfg.num_experts, cfg.intermediate_size, cfg.hidden_size)
    gen = torch.Generator(device=dev).manual_seed(1)
    p = torch.randn(shape, device=dev, generator=gen).bfloat16()
    g, m = (torch.randn(shape, device=dev, generator=gen).bfloat16() for _ in range(2))
    v = torch.rand(shape, device=dev, generator=gen).bfloat16()
    param = torch.nn.Parameter(p.clone())
    param.grad = g
    ref = torch.optim.AdamW([param], lr=1e-6, fused=True)
    ref.step()
    hyper = adamw.AdamWStep(1e-6, 0.9, 0.999, 1e-8, 0.01, 2)

    def copies(rows: int, warps: int, reread: bool):
        def run():
            old = adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD
            adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD = rows, warps, reread
            try:
                return adamw.adamw_quantize_(p, g, m, v, hyper)
            finally:
                adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD = old

        return run

    cases = {"torch fused": ref.step, "megamoe plain": lambda: adamw.adamw_(p, g, m, v, hyper)}
    cases.update({
        f"copies rows={r} warps={w}{' reread' if b else ''}": copies(r, w, b) for r, w, b in PARTS
    })  # fmt: skip
    cases["quantize_weight"] = lambda: fp8.quantize_weight(p, transposed=True)
    # the bits of each parts choice from the same state: (p, m, v) and the copies
    state = [t.clone() for t in (p, m, v)]
    bits = {}
    for key in cases:
        if key.startswith("copies"):
            for t, s0 in zip((p, m, v), state):
                t.copy_(s0)
            w = cases[key]()
            bits[key] = [t.clone() for t in (p, m, v)] + [
                t.view(torch.uint8) if t.dtype == fp8.FP8 else t for t in w
            ]
    first = bits[next(iter(bits))]
    same = {key: all(torch.equal(a, b) for a, b in zip(first, b_)) for key, b_ in bits.items()}
    times: dict = {key: [] for key in cases}
    for _ in range(rounds):
        for key, fn in cases.items():
            times[key].append(statistics.median(event_times_ms(fn, 5)))
    numel = p.numel()
    out = {"model": name, "shape": list(shape), "cases": {}}
    for key in cases:
        ms = statistics.median(times[key])
        nbytes = {"quantize_weight": 4}.get(key, 16 if key.startswith("copies") else 14) * numel
        out["cases"][key] = {"ms": ms, "GB/s": nbytes / ms / 1e6, "same_bits": same.get(key)}
        print(f"{name:>16} {key:>33}: {ms:7.3f} ms  {nbytes / ms / 1e6:6.0f} GB/s "
              f"{'' if key not in same else 'same bits' if same[key] else 'BITS DIFFER'}",
              flush=True)  # fmt: skip
    return out


def _config(name: str, tokens: int | None):
    try:
        preset = get_preset(name)
        return preset.config(), tokens or preset.tokens_per_rank
    except ValueError:
        shape = get_model_shape(name)
        return shape.config(), tokens or 16384


def _run_model(
    name: str, tokens: int | None, iters: int, rounds: int, reread: tuple[int, int]
) -> dict:
    cfg, t = _config(name, tokens)
    dev = torch.device("cuda")
    layers = {
        "bf16": megamoe.MoE(cfg, backend="triton", device=dev, seed=0),
        "fp8": megamoe.MoE(dataclasses.replace(cfg, precision="fp8"), backend="triton", device=dev),
    }
    for pname, param in layers["bf16"].named_parameters():  # one set of weights for both
        setattr(layers["fp8"], pname, param)
    params = list(layers["bf16"].parameters())
    kw = dict(lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optimizers = {
        "torch": torch.optim.AdamW(params, fused=True, **kw),
        "plain": optim.AdamW(params, **kw),
        "copies": optim.AdamW(params, **kw, fp8_views=layers["fp8"].fp8_weight_views()),
    }
    runs = {
        "bf16+torch": (layers["bf16"], optimizers["torch"]),
        "bf16+megamoe": (layers["bf16"], optimizers["plain"]),
        "fp8+torch": (layers["fp8"], optimizers["torch"]),
        "fp8+plain": (layers["fp8"], optimizers["plain"]),
        "fp8+megamoe": (layers["fp8"], optimizers["copies"]),
        "fp8+reread": (layers["fp8"], optimizers["copies"]),
    }
    parts = {"fp8+reread": (*reread, True)}  # (rows, warps, read back) of the copies' update
    gen = torch.Generator(device=dev).manual_seed(0)
    h, e, k = cfg.hidden_size, cfg.num_experts, cfg.top_k
    x = torch.randn(t, h, device=dev, generator=gen).bfloat16().requires_grad_(True)
    ids = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=1).indices
    tw = torch.rand(t, k, device=dev, generator=gen).softmax(-1).requires_grad_(True)
    dy = torch.randn(t, h, device=dev, generator=gen).bfloat16()

    def step(layer, opt, marks=None) -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = tw.grad = None
        if marks:
            marks[0].record()
        layer(x, ids, tw).backward(dy)
        if marks:
            marks[1].record()
        opt.step()
        if marks:
            marks[2].record()

    times = {v: {"step": [], "fwd_bwd": [], "opt": []} for v in VARIANTS}
    quantized = {v: 0 for v in VARIANTS}
    default = adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD
    for r in range(rounds):
        for v in VARIANTS:
            layer, opt = runs[v]
            adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD = parts.get(v, default)
            step(layer, opt)  # (untimed: compiles once; the copies of the last update)
            marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
            before = fp8_weights.CACHE.quantizations
            for m in marks:
                step(layer, opt, m)
            torch.cuda.synchronize()
            quantized[v] += fp8_weights.CACHE.quantizations - before
            for a, b, c in marks:
                times[v]["step"].append(a.elapsed_time(c))
                times[v]["fwd_bwd"].append(a.elapsed_time(b))
                times[v]["opt"].append(b.elapsed_time(c))
        adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD = default
        print(f"  {name}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    med = {v: {key: statistics.median(ts) for key, ts in times[v].items()} for v in VARIANTS}
    for v in VARIANTS:
        med[v]["layer_ms"] = med[v]["fwd_bwd"]
    for v in ("fp8+megamoe", "fp8+reread"):
        med[v]["layer_ms"] += med[v]["opt"] - med["bf16+megamoe"]["opt"]
    base = med["bf16+torch"]
    out = {
        "model": name,
        "tokens": t,
        "experts": e,
        "weights": sum(p.numel() for p in params),
        "weight_quantizations": quantized,
        "variants": med,
        "ratios": {
            v: {key: base[key] / med[v][key] for key in ("step", "layer_ms")} for v in VARIANTS
        },
    }
    del layers, optimizers, runs, params
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["dsv3", "qwen3-30b"])
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernels", action="store_true", help="the updates alone first")
    parser.add_argument("--reread-parts", default="32,8", help="fp8+reread's rows a part, warps")
    parser.add_argument("--out")
    args = parser.parse_args()
    records = []
    kernels = [_kernels(name, args.tokens, args.rounds) for name in args.models if args.kernels]
    reread = tuple(int(n) for n in args.reread_parts.split(","))
    for name in args.models if args.iters else ():  # (--iters 0: the kernels alone)
        try:
            rec = _run_model(name, args.tokens, args.iters, args.rounds, reread)
        except torch.cuda.OutOfMemoryError as exc:
            rec = {"model": name, "error": f"OutOfMemoryError: {str(exc)[:200]}"}
            torch.cuda.empty_cache()
        records.append(rec)
        if "error" in rec:
            print(f"{name}: {rec['error']}", flush=True)
            continue
        for v in VARIANTS:
            m, r = rec["variants"][v], rec["ratios"][v]
            print(
                f"{name:>16} {v:>13}: step {m['step']:7.2f} ms (x{r['step']:.3f})  fwd+bwd "
                f"{m['fwd_bwd']:7.2f}  opt {m['opt']:6.2f}  layer {m['layer_ms']:7.2f} ms "
                f"(x{r['layer_ms']:.3f})  quantized {rec['weight_quantizations'][v]}",
                flush=True,
            )
    if args.out:
        meta = {
            "probe": "optimizer_fp8",
            "gpu": torch.cuda.get_device_name(),
            "commit": os.environ.get("MEGAMOE_COMMIT", "unknown"),
            "torch": torch.__version__,
            "iters": args.iters,
            "rounds": args.rounds,
            "reread_parts": list(reread),
        }
        with open(args.out, "w") as f:
            json.dump({**meta, "kernels": kernels, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
