"""Probe (one GPU): backend "fused"'s pipelined fp8 forward as W > 1 runs it (the comm
kernel's pulls beside the warp-specialized GEMMs, down counting its stored tiles while the
comm programs push z, the barriers, the slots' combine) on a one-rank workspace, against the
same with the push after down on every SM (``comm.combine_push``: the forward before the
push moved beside down) and backend "triton"'s fp8 forward (what one process runs),
interleaved, with the same bits.

    PYTHONPATH=. python benchmarks/probes/pipelined_protocol.py [--models dsv3 qwen3-30b]
        [--tokens 4096] [--rounds 5] [--iters 5] [--out probe.json]

Per model (``megamoe.tools.harness.make_case`` at W = 1, uniform routing, fp8 weights
quantized once before timing): the median ms of each forward, the ratios triton / protocol
and push-after / push-beside, the pull programs, and whether y is bitwise the same (every
round).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from megamoe.backends import experts, fused, steps
from megamoe.backends import triton as triton_backend
from megamoe.ep import checks
from megamoe.kernels import comm, fp8, fp8_gemm
from megamoe.kernels.fused.forward import start_pulls
from megamoe.kernels.fused.plan import pull_programs_for
from megamoe.kernels.runtime import persistent_programs
from megamoe.tools.bench_kernels import event_times_ms
from megamoe.tools.harness import init_distributed, make_case
from megamoe.types import RoutedActivations


def _push_after_down(ws, schedule, weights, x, fp8w):
    """``fused._pipelined_experts`` with down on every SM and then ``comm.combine_push``."""
    config, sched = schedule.config, schedule.routed
    tokens = steps.published_tokens(ws, x, config)
    h, i = config.hidden_size, config.intermediate_size
    pulls = start_pulls(ws, sched, i, config.comm_programs, config.minibatch_rows)
    try:
        shared, shared_out = experts.shared_forward(tokens, weights, config, pulls.programs, fp8w)
        xq, xq_s = fp8.unpack_rows(pulls.rows, h)
        g, u, (hq, hq_s), h_cols = fp8_gemm.gate_up_quantized(
            xq, xq_s, fp8w.gate, fp8w.up, sched, pulls.programs, pulls.arrivals
        )
        z = fp8_gemm.grouped_mm(hq, hq_s, fp8w.down, sched)
    finally:
        pulls.join()
    comm.combine_push(ws, z, sched, "combine", programs=config.copy_programs)
    return RoutedActivations(pulls.rows, g, u, h_cols, z), shared, shared_out


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

    def push_after() -> torch.Tensor:
        beside, fused._pipelined_experts = fused._pipelined_experts, _push_after_down
        try:
            return protocol()
        finally:
            fused._pipelined_experts = beside

    ways = {"triton": unfused, "protocol": protocol, "push_after": push_after}
    times: dict[str, list[float]] = {way: [] for way in ways}
    same = True
    with torch.no_grad():
        for _ in range(args.rounds):
            first, *others = [fn() for fn in ways.values()]
            same &= all(torch.equal(first, o) for o in others)
            for way, fn in ways.items():
                times[way] += event_times_ms(fn, args.iters)
        checks.eager_check(checks.device_records(x.device))
    ms = {way: statistics.median(t) for way, t in times.items()}
    h, i = config.hidden_size, config.intermediate_size
    pulls = pull_programs_for(persistent_programs(x.device), h, i, 2 * fp8.packed_width(h), 1)
    return dict(
        shape=name, tokens=args.tokens, ms_triton=ms["triton"], ms_protocol=ms["protocol"],
        ms_push_after=ms["push_after"], protocol_over_triton=ms["triton"] / ms["protocol"],
        beside_over_after=ms["push_after"] / ms["protocol"],
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
            f"{name:22s} triton {r['ms_triton']:7.3f}  protocol {r['ms_protocol']:7.3f}  "
            f"push after down {r['ms_push_after']:7.3f} ms  protocol/triton "
            f"{r['protocol_over_triton']:.3f}  beside/after {r['beside_over_after']:.3f}  "
            f"pulls {r['pull_programs']}  same bits {r['same_bits']}",
            flush=True,
        )
        records.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
