"""Probe (one GPU): backend "fused"'s pipelined fp8 forward as W > 1 runs it (the comm
kernel's pulls beside the warp-specialized GEMMs, down counting its stored tiles while the
comm programs push z, the barriers, the slots' combine) on a one-rank workspace, against
backend "triton"'s fp8 forward (what one process runs), interleaved, with the same bits.

    PYTHONPATH=. python benchmarks/probes/pipelined_protocol.py [--models dsv3 qwen3-30b]
        [--tokens 4096] [--rounds 5] [--iters 5] [--out probe.json]

Per model (``megamoe.tools.harness.make_case`` at W = 1, uniform routing, fp8 weights
quantized once before timing): the median ms of each forward, the ratio triton / protocol,
the pull programs, and whether y is bitwise the same (every round).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from megamoe.backends import fused, steps
from megamoe.backends import triton as triton_backend
from megamoe.ep import checks
from megamoe.kernels import fp8
from megamoe.kernels.fused.plan import pull_programs_for
from megamoe.kernels.runtime import persistent_programs
from megamoe.tools.bench_kernels import event_times_ms
from megamoe.tools.harness import init_distributed, make_case


def _measure(name: str, args, env) -> dict:
    case = make_case(name, env, tokens=args.tokens)
    config = case.config.replace(precision="fp8")
    x, ids, w = case.x.detach(), case.topk_ids, case.topk_weights.detach()
    weights = case.weights

    def protocol() -> torch.Tensor:
        sched = fused.build_schedule(ids, config, None)
        xp, wp, wts, sched = steps.prepare(x, ids, w, weights, config, None, sched)
        run = steps.single_rank(sched, ids)
        y, _ = steps.run_steps(fused.forward_steps(xp, wp, wts, run), run.ep.workspace)
        return y

    def unfused() -> torch.Tensor:
        sched = triton_backend.build_schedule(ids, config, None)
        return triton_backend.forward(x, ids, w, weights, config, None, sched)[0]

    ways = {"triton": unfused, "protocol": protocol}
    times: dict[str, list[float]] = {way: [] for way in ways}
    same = True
    with torch.no_grad():
        for _ in range(args.rounds):
            outs = [fn() for fn in ways.values()]
            same &= torch.equal(outs[0], outs[1])
            for way, fn in ways.items():
                times[way] += event_times_ms(fn, args.iters)
        checks.eager_check(checks.device_records(x.device))
    ms = {way: statistics.median(t) for way, t in times.items()}
    h, i = config.hidden_size, config.intermediate_size
    pulls = pull_programs_for(persistent_programs(x.device), h, i, 2 * fp8.packed_width(h), 1)
    return dict(
        shape=name, tokens=args.tokens, ms_triton=ms["triton"], ms_protocol=ms["protocol"],
        protocol_over_triton=ms["triton"] / ms["protocol"],
        pull_programs=pulls, same_bits=bool(same), checked_runs=args.rounds,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dsv3", "qwen3-30b"])
    p.add_argument("--tokens", type=int, default=None, help="per model's default if unset")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    env = init_distributed()
    records = []
    for name in args.models:
        r = _measure(name, args, env)
        print(
            f"{name:22s} triton {r['ms_triton']:7.3f} ms  protocol {r['ms_protocol']:7.3f} ms  "
            f"ratio {r['protocol_over_triton']:.3f}  pulls {r['pull_programs']}  "
            f"same bits {r['same_bits']}",
            flush=True,
        )
        records.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
