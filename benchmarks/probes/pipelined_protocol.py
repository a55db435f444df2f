"""Probe (one GPU): backend "fused"'s pipelined fp8 forward as W > 1 runs it (the comm
kernel's pulls beside the warp-specialized GEMMs, down counting its stored tiles while the
comm programs push z, the barriers, the slots' combine) on a one-rank workspace, against the
same with the push after down on every SM (``comm.combine_push``: the forward before the
push moved beside down) and backend "triton"'s fp8 forward (what one process runs),
interleaved, with the same bits; the push beside down with each of ``--push-programs``
(``auto``: ``plan.push_programs_for``).

    PYTHONPATH=. python benchmarks/probes/pipelined_protocol.py [--models dsv3 qwen3-30b]
        [--push-programs auto 8 16 32] [--tokens 4096] [--rounds 5] [--iters 5]
        [--out probe.json]

Per model (``megamoe.tools.harness.make_case`` at W = 1, uniform routing, fp8 weights
quantized once before timing): the median ms of each forward, the ratios triton / protocol
and push-after / push-beside for each push program count, the pull programs, and whether y
is bitwise the same (every round).
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
from megamoe.kernels.fused.plan import pull_programs_for, push_programs_for
from megamoe.kernels.runtime import persistent_programs
from megamoe.tools.bench import git_commit
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

    def protocol(push_programs: int | None) -> torch.Tensor:
        cfg = config.replace(push_programs=push_programs)
        sched = fused.build_schedule(ids, cfg, None)
        xp, wp, wts, sched = steps.prepare(x, ids, w, weights, cfg, None, sched)
        run = steps.single_rank(sched, ids)
        y, _ = steps.run_steps(fused.forward_steps(xp, wp, wts, run), run.ep.workspace)
        return y

    def unfused() -> torch.Tensor:
        sched = triton_backend.build_schedule(ids, config, None)
        return triton_backend.forward(x, ids, w, weights, config, None, sched)[0]

    def push_after() -> torch.Tensor:
        beside, fused._pipelined_experts = fused._pipelined_experts, _push_after_down
        try:
            return protocol(None)
        finally:
            fused._pipelined_experts = beside

    programs = persistent_programs(x.device)
    h, i = config.hidden_size, config.intermediate_size
    counts = [push_programs_for(programs, i) if p == "auto" else int(p) for p in args.push_programs]
    ways = {"triton": unfused, "push_after": push_after}
    ways.update({f"beside_{c}": (lambda c=c: protocol(c)) for c in dict.fromkeys(counts)})
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
    derived = push_programs_for(programs, i)
    return dict(
        shape=name, tokens=args.tokens, ms=ms,
        protocol_over_triton=ms["triton"] / ms[f"beside_{counts[0]}"],
        beside_over_after={c: ms["push_after"] / ms[f"beside_{c}"] for c in dict.fromkeys(counts)},
        pull_programs=pull_programs_for(programs, h, i, 2 * fp8.packed_width(h), 1),
        derived_push_programs=derived, same_bits=bool(same), checked_runs=args.rounds,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dsv3", "qwen3-30b"])
    p.add_argument("--push-programs", nargs="+", default=["auto"], help="counts or auto")
    p.add_argument("--tokens", type=int, default=None, help="per model's default if unset")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    env = init_distributed()
    records = []
    for name in args.models:
        r = _measure(name, args, env)
        ms = r["ms"]
        beside = "  ".join(f"beside[{c}] {ms[f'beside_{c}']:.3f}" for c in r["beside_over_after"])
        print(
            f"{name:12s} triton {r['ms']['triton']:.3f}  push after down "
            f"{r['ms']['push_after']:.3f}  {beside} ms  (derived {r['derived_push_programs']}, "
            f"pulls {r['pull_programs']})  same bits {r['same_bits']}",
            flush=True,
        )
        records.append(r)
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), commit=git_commit(), args=vars(args))
        with open(args.out, "w") as f:
            json.dump({**meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
