"""NVLink bandwidth of the dispatch pull and combine push kernels, in GB/s of remote bytes.

Run under torchrun (one process per GPU)::

    torchrun --nproc-per-node=2 -m megamoe.tools.bench_comm --out comm.json

Every rank moves its rows at the same time (each timed iteration starts right after a device
barrier). Only bytes that cross NVLink count: rows a rank pulls from a peer (dispatch) or pushes to
a peer (combine); rows of the rank's own tokens are copied too but not counted. The unscaled
pull reads a token's row once per rank (``comm.pull_tokens``), however many of the rank's rows
it fills, so its GB/s is of the remote rows delivered, more than crossed NVLink. A time is the
median over iterations of the per-iteration maximum over ranks; GB/s is the remote bytes of the
busiest rank (the most remote rows; with uniform routing every rank moves about the same) over that
time. ``megamoe bench`` reuses :func:`layer_comm_gbps` to time the layer's own copies on the
schedule of its real routing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import triton

from ..ep.workspace import Workspace, check_errors, get_workspace, publish
from ..kernels import comm
from ..kernels.schedule import RowSchedule, build_row_schedule

__all__ = [
    "bench_comm",
    "routed_problem",
    "remote_rows",
    "remote_bytes_per_rank",
    "remote_gbps",
    "time_op",
    "measure_op",
    "copy_ops",
    "layer_comm_gbps",
    "LAYER_FIELDS",
    "main",
]

_DEFAULT_PROGRAMS = (8, 16, 24)
_DEFAULT_TILE_KB = (32, 64, 128)
_DEFAULT_WARPS = (8, 16)
# A copy task lives in registers: skip (tile, warps) pairs that need more than this per thread.
_MAX_TILE_BYTES_PER_THREAD = 256
_BLOCK_ROWS = 128
_ENV_KEYS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def routed_problem(
    ws: Workspace, local_experts: int, seed: int = 0, block_rows: int = _BLOCK_ROWS
) -> RowSchedule:
    """Publish random tokens, dy and uniform top-k routing, exchange routing, build the schedule."""
    t, h, k, w = ws.num_tokens, ws.hidden, ws.top_k, ws.world_size
    gen = torch.Generator(device=ws.device).manual_seed(seed * 1000 + ws.rank)
    e = local_experts * w
    x = torch.randn(t, h, generator=gen, device=ws.device).to(ws.dtype)
    dy = torch.randn(t, h, generator=gen, device=ws.device).to(ws.dtype)
    ids = torch.rand(t, e, generator=gen, device=ws.device).argsort(dim=1)[:, :k]
    weights = torch.rand(t, k, generator=gen, device=ws.device).softmax(dim=1)
    publish(ws, x=x, topk_ids=ids, topk_weights=weights, dy=dy if ws.backward else None)
    comm.barrier(ws)
    all_ids, _ = comm.gather_routing(ws)
    return build_row_schedule(all_ids, local_experts, block_rows, expert_lo=ws.rank * local_experts)


def remote_rows(ws: Workspace, sched: RowSchedule) -> int:
    """Rows of this rank's layout whose token lives on another rank (a host read; setup only)."""
    used = int(sched.num_blocks.item()) * sched.block_rows
    slots = sched.row_src[:used].long()
    return int(((slots >= 0) & (slots // ws.slots != ws.rank)).sum().item())


def remote_bytes_per_rank(
    ws: Workspace, sched: RowSchedule, group: dist.ProcessGroup | None = None
) -> list[int]:
    """Every rank's remote rows x H x itemsize: the bytes its push moves over NVLink, and its
    pull delivers (an unscaled pull reads each token's row once, however many rows it fills)."""
    mine = remote_rows(ws, sched) * ws.hidden * ws.dtype.itemsize
    everyone: list[int] = [0] * ws.world_size
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def remote_gbps(remote_bytes: Sequence[int], ms: float) -> float:
    """GB/s of the busiest rank's remote bytes over ``ms`` (a per-iteration max over ranks).

    The busiest rank finished within ``ms``, so this is a lower bound on its own rate.
    """
    return max(remote_bytes) / (ms * 1e-3) / 1e9


def time_op(
    ws: Workspace,
    fn: Callable[[], object],
    iters: int,
    warmup: int,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """Per-iteration times (ms), maximum over ranks; each iteration starts after a barrier."""
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for _ in range(warmup):
        comm.barrier(ws)
        fn()
    for start, end in events:
        comm.barrier(ws)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in events], device=ws.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.tolist()


def measure_op(
    ws: Workspace,
    fn: Callable[[], object],
    remote_bytes: Sequence[int],
    iters: int,
    warmup: int,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """median_ms, min_ms (of the per-iteration max over ranks) and GB/s of remote bytes of ``fn``;
    raises if a barrier stalled."""
    times = time_op(ws, fn, iters, warmup, group)
    check_errors(ws)
    med = statistics.median(times)
    return {"median_ms": med, "min_ms": min(times), "gbps": remote_gbps(remote_bytes, med)}


def copy_ops(
    ws: Workspace, sched: RowSchedule, rows: torch.Tensor, scale_dy: bool = True
) -> dict[str, Callable[..., object]]:
    """The row copies of a layer step on ``sched``; call each with programs, tile_bytes, num_warps.

    dispatch: pull x rows into ``rows``; combine: push ``rows`` to the combine slots; with a
    backward workspace also dispatch_dy (pull dy rows, scaled by the router weight unless
    ``scale_dy`` is False) and combine_dx (push ``rows`` to the d_x slots).
    """
    ops: dict[str, Callable[..., object]] = {
        "dispatch": functools.partial(comm.dispatch_pull, ws, sched, "x", out=rows),
        "combine": functools.partial(comm.combine_push, ws, rows, sched, "combine"),
    }
    if ws.backward:
        ops["dispatch_dy"] = functools.partial(
            comm.dispatch_pull, ws, sched, "dy", out=rows, scale=scale_dy
        )
        ops["combine_dx"] = functools.partial(comm.combine_push, ws, rows, sched, "dx")
    return ops


# Record field of each copy of the layer (megamoe bench).
LAYER_FIELDS = {
    "dispatch": "dispatch_gbps",
    "combine": "combine_gbps",
    "dispatch_dy": "dispatch_bwd_gbps",
    "combine_dx": "combine_bwd_gbps",
}


def layer_comm_gbps(
    ws: Workspace,
    sched: RowSchedule,
    programs: int,
    iters: int,
    warmup: int,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """GB/s of remote bytes of the layer's own copies on its schedule, as backend "triton" runs
    them (``programs``, default tiles, unscaled dy pull): fields of :data:`LAYER_FIELDS`.

    A collective: every rank calls it with its own schedule; x and dy must be published.
    """
    rows = torch.zeros(sched.rows, ws.hidden, dtype=ws.dtype, device=ws.device)
    remote = remote_bytes_per_rank(ws, sched, group)
    ops = copy_ops(ws, sched, rows, scale_dy=False)
    return {
        LAYER_FIELDS[op]: measure_op(
            ws, functools.partial(fn, programs=programs), remote, iters, warmup, group
        )["gbps"]
        for op, fn in ops.items()
    }


# The ops of the sweep (the backward push moves the same bytes as the forward one).
_SWEEP_OPS = ("dispatch", "combine", "dispatch_dy")


def bench_comm(
    group: dist.ProcessGroup | None = None,
    tokens: int = 4096,
    hidden: int = 7168,
    top_k: int = 8,
    local_experts: int = 32,
    programs: tuple[int, ...] = _DEFAULT_PROGRAMS,
    tile_kb: tuple[int, ...] = _DEFAULT_TILE_KB,
    num_warps: tuple[int, ...] = _DEFAULT_WARPS,
    iters: int = 20,
    warmup: int = 3,
    backward: bool = True,
) -> list[dict]:
    """Dispatch / combine (and the scaled dy pull) GB/s for every (programs, tile, warps).

    Pairs whose tile needs more than 256 bytes of registers per thread are skipped.
    """
    ws = get_workspace(group, tokens, hidden, top_k, torch.bfloat16, backward=backward)
    sched = routed_problem(ws, local_experts)
    remote = remote_bytes_per_rank(ws, sched, group)
    row_bytes = hidden * ws.dtype.itemsize
    used = int(sched.num_blocks.item()) * sched.block_rows
    pulled = torch.zeros(sched.rows, hidden, dtype=ws.dtype, device=ws.device)
    ref_pull = comm.dispatch_pull(ws, sched, programs=16)[:used].clone()
    ops = copy_ops(ws, sched, pulled)
    meta = {
        "world_size": ws.world_size,
        "tokens_per_rank": tokens,
        "hidden": hidden,
        "top_k": top_k,
        "local_experts": local_experts,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: os.environ.get(k) for k in _ENV_KEYS},
    }
    records = []
    for op in (o for o in _SWEEP_OPS if o in ops):
        for nw in num_warps:
            for kb in tile_kb:
                if kb * 1024 > nw * 32 * _MAX_TILE_BYTES_PER_THREAD:
                    continue
                for p in programs:
                    run = functools.partial(ops[op], programs=p, tile_bytes=kb * 1024, num_warps=nw)
                    m = measure_op(ws, run, remote, iters, warmup, group)
                    same = bool(torch.equal(pulled[:used], ref_pull)) if op == "dispatch" else None
                    records.append(
                        dict(
                            meta,
                            op=op,
                            programs=p,
                            tile_bytes=kb * 1024,
                            num_warps=nw,
                            median_ms=m["median_ms"],
                            min_ms=m["min_ms"],
                            remote_rows=[b // row_bytes for b in remote],
                            remote_bytes=remote,
                            gbps=m["gbps"],
                            bitwise_same_as_16_programs=same,
                        )
                    )
    return records


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the records here as a JSON list")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--local-experts", type=int, default=32)
    ap.add_argument("--programs", type=_ints, default=_DEFAULT_PROGRAMS)
    ap.add_argument("--tile-kb", type=_ints, default=_DEFAULT_TILE_KB)
    ap.add_argument("--warps", type=_ints, default=_DEFAULT_WARPS)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        records = bench_comm(
            None,
            args.tokens,
            args.hidden,
            args.top_k,
            args.local_experts,
            args.programs,
            args.tile_kb,
            args.warps,
            args.iters,
            args.warmup,
        )
        if dist.get_rank() == 0:
            print(f"{'op':<12} {'programs':>8} {'tile KB':>8} {'warps':>5} {'ms':>8} {'GB/s':>7}")
            for r in records:
                print(
                    f"{r['op']:<12} {r['programs']:>8} {r['tile_bytes'] // 1024:>8} "
                    f"{r['num_warps']:>5} {r['median_ms']:>8.3f} {r['gbps']:>7.1f}"
                )
            for op in dict.fromkeys(r["op"] for r in records):
                best = max((r for r in records if r["op"] == op), key=lambda r: r["gbps"])
                print(
                    f"best {op}: {best['gbps']:.1f} GB/s of remote bytes with {best['programs']} "
                    f"programs, {best['tile_bytes'] // 1024} KB tiles, {best['num_warps']} warps"
                )
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(records, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
