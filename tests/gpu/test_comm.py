"""Symmetric workspace, device barrier, pull dispatch and push combine on real GPUs over NVLink.

Run on a 2-GPU machine (any world size works)::

    torchrun --nproc-per-node=2 -m pytest -q tests/gpu/test_comm.py

Every rank runs the same tests in the same order. Each test does all its collective work first and
then agrees on a verdict (an all-gather of every rank's result), so one rank's failure never leaves
the other waiting in a collective.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megamoe.ep.workspace import check_errors, get_workspace, publish
from megamoe.errors import StallError
from megamoe.kernels import comm
from megamoe.kernels.schedule import build_row_schedule
from megamoe.tools.bench_comm import bench_comm
from support.dist import agree, release_workspaces

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "WORLD_SIZE" not in os.environ,
    reason="needs CUDA GPUs and torchrun (WORLD_SIZE)",
)

T, H, K, E_LOCAL, BLOCK_ROWS = 256, 7168, 8, 8, 128


@pytest.fixture(scope="module")
def group(nccl_world):
    yield nccl_world[0]
    release_workspaces()


def _encode(slot: torch.Tensor, h: int) -> torch.Tensor:
    """bf16-exact values that identify a global slot."""
    j = torch.arange(h, device=slot.device)
    return (((slot[:, None] * 31 + j[None, :] * 7) % 241) - 120).to(torch.bfloat16)


class Problem:
    """Every rank's inputs, reproducible on every rank (CPU generator per source rank)."""

    def __init__(self, world: int, routing: str, seed: int = 0) -> None:
        e = E_LOCAL * world
        self.x, self.dy, self.ids, self.tw = [], [], [], []
        for r in range(world):
            gen = torch.Generator().manual_seed(seed * 100 + r)
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
            x[:, 0], x[:, 1], x[:, 2] = r, torch.arange(T) % 128, torch.arange(T) // 128
            self.x.append(x)
            self.dy.append(torch.randn(T, H, generator=gen).to(torch.bfloat16))
            if routing == "uniform":
                ids = torch.rand(T, e, generator=gen).argsort(dim=1)[:, :K]
            elif routing == "one-rank":  # every token of every rank to the last rank's experts
                ids = (
                    torch.rand(T, E_LOCAL, generator=gen).argsort(dim=1)[:, :K]
                    + (world - 1) * E_LOCAL
                )
            else:  # skewed: Zipf-like preference for low expert ids, distinct per token
                scores = torch.rand(T, e, generator=gen) / (torch.arange(e) + 1.0) ** 1.2
                ids = scores.argsort(dim=1, descending=True)[:, :K]
            self.ids.append(ids)
            self.tw.append(torch.rand(T, K, generator=gen).softmax(dim=1))


def _setup(routing: str, seed: int = 0):
    """Publish this rank's inputs, barrier, exchange routing, schedule the local experts."""
    ws = get_workspace(None, T, H, K)
    rank, world = ws.rank, ws.world_size
    prob = Problem(world, routing, seed)
    dev = ws.device
    publish(
        ws,
        x=prob.x[rank].to(dev),
        topk_ids=prob.ids[rank].to(dev),
        topk_weights=prob.tw[rank].to(dev),
        dy=prob.dy[rank].to(dev),
    )
    comm.barrier(ws)
    ids, weights = comm.gather_routing(ws)
    sched = build_row_schedule(ids, E_LOCAL, BLOCK_ROWS, expert_lo=rank * E_LOCAL)
    routing_ok = torch.equal(ids.cpu(), torch.cat(prob.ids).to(torch.int32)) and torch.equal(
        weights.cpu(), torch.cat(prob.tw)
    )
    return ws, prob, sched, routing_ok


def _slots(sched) -> tuple[int, torch.Tensor]:
    used = int(sched.num_blocks.item()) * BLOCK_ROWS
    return used, sched.row_src[:used].long().cpu()


def test_workspace_rendezvous(group):
    ws = get_workspace(group, T, H, K)
    same = get_workspace(group, T, H, K) is ws
    rank, world = ws.rank, ws.world_size
    ok = same and ws.peers.x[rank].item() == ws.x_buffer.data_ptr()
    ok &= ws.peers.combine[rank].item() == ws.combine_buffer.data_ptr()
    # Cross-check the tables against torch's own peer views, and read a peer with a torch op.
    ws.x_buffer.fill_(rank + 1)
    comm.barrier(ws)
    seen = []
    for p in range(world):
        view = ws.handle.get_buffer(p, [ws.storage.numel()], torch.uint8)
        shift = ws.x_buffer.data_ptr() - ws.storage.data_ptr()
        ok &= view.data_ptr() + shift == ws.peers.x[p].item()
        seen.append(view[shift : shift + T * H * 2].view(torch.bfloat16).float().unique().tolist())
    comm.barrier(ws)
    torch.cuda.synchronize()
    check_errors(ws)
    agree(ok and seen == [[p + 1.0] for p in range(world)], f"tables/peer views wrong: {seen}")


def test_barrier_orders_peer_reads(group):
    """Write, barrier, read the peer (torch copy over NVLink), barrier: 30 rounds, no host sync."""
    ws = get_workspace(group, T, H, K)
    rank, world = ws.rank, ws.world_size
    peer = (rank + 1) % world
    view = ws.handle.get_buffer(peer, [ws.storage.numel()], torch.uint8)
    shift = ws.x_buffer.data_ptr() - ws.storage.data_ptr()
    peer_x = view[shift : shift + T * H * 2].view(torch.bfloat16).view(T, H)
    epochs_before = ws.epochs.clone()
    got = []
    for i in range(30):
        ws.x_buffer.fill_(float(i * world + rank))
        comm.barrier(ws)
        got.append(peer_x[::17, ::97].clone())
        comm.barrier(ws)  # the peer is done reading before anyone writes again
    torch.cuda.synchronize()
    check_errors(ws)
    ok = all(torch.all(g == i * world + peer).item() for i, g in enumerate(got))
    ok &= (ws.epochs - epochs_before)[0].item() == 60
    agree(ok, "a peer read saw a value from the wrong round")


@pytest.mark.parametrize("routing", ["uniform", "one-rank", "zipf"])
def test_dispatch_lands_every_row(group, routing):
    ws, prob, sched, routing_ok = _setup(routing)
    outs = []
    for programs in (16, 1, 24):
        out = torch.full((sched.rows, H), float("nan"), dtype=torch.bfloat16, device=ws.device)
        comm.dispatch_pull(ws, sched, out=out, programs=programs)
        outs.append(out)
    comm.barrier(ws)  # peers finished pulling before the next test republishes
    torch.cuda.synchronize()
    check_errors(ws)
    used, slots = _slots(sched)
    out = outs[0].cpu()
    real = slots >= 0
    tk = T * K
    allx = torch.cat(prob.x)
    ok = routing_ok and torch.equal(out[:used][real], allx[slots[real] // K])
    ok &= torch.equal(out[:used][real][:, 0].long(), slots[real] // tk)
    ok &= torch.equal(
        (out[:used][real][:, 1] + 128 * out[:used][real][:, 2]).long(), (slots[real] % tk) // K
    )
    ok &= bool(torch.all(out[:used][~real] == 0)) and bool(torch.all(out[used:].isnan()))
    # Bit patterns, so the untouched NaN tail compares equal too (NaN != NaN as floats).
    ok &= all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    agree(ok, f"dispatch wrong for routing={routing} (used rows {used})")


def test_dispatch_dy_scaled_bitwise(group):
    ws, prob, sched, routing_ok = _setup("uniform", seed=1)
    out = comm.dispatch_pull(ws, sched, source="dy")
    comm.barrier(ws)
    torch.cuda.synchronize()
    check_errors(ws)
    used, slots = _slots(sched)
    real = slots >= 0
    alldy, allw = torch.cat(prob.dy), torch.cat(prob.tw).view(-1)
    want = (alldy[slots[real] // K].float() * allw[slots[real]][:, None]).to(torch.bfloat16)
    got = out.cpu()[:used]
    agree(
        routing_ok and torch.equal(got[real], want) and bool(torch.all(got[~real] == 0)),
        "scaled dy rows differ",
    )


@pytest.mark.parametrize("routing", ["uniform", "one-rank"])
def test_push_writes_every_slot_once(group, routing):
    ws, prob, sched, routing_ok = _setup(routing, seed=2)
    rank = ws.rank
    tk = ws.slots
    used, slots = _slots(sched)
    gen = torch.Generator().manual_seed(rank)
    rows = torch.randn(sched.rows, H, generator=gen).to(torch.bfloat16)  # padding rows: garbage
    real_rows = torch.nonzero(slots >= 0).view(-1)
    rows[real_rows] = _encode(slots[real_rows], H)
    rows = rows.to(ws.device)
    values = torch.rand(sched.rows, generator=gen) - 5.0
    values[real_rows] = slots[real_rows].float() + 0.5
    values = values.to(ws.device)
    ws.combine_buffer.fill_(float("nan"))
    ws.dx_slots.fill_(float("nan"))
    ws.dw_slots.fill_(float("nan"))
    comm.barrier(ws)  # everyone poisoned before anyone pushes
    comm.combine_push(ws, rows, sched)
    comm.combine_push(ws, rows, sched, target="dx", programs=8)
    comm.push_row_values(ws, values, sched)
    comm.barrier(ws)  # every push landed
    torch.cuda.synchronize()
    check_errors(ws)
    mine = torch.arange(rank * tk, (rank + 1) * tk)
    want = _encode(mine, H)
    ok = routing_ok and torch.equal(ws.combine_buffer.cpu(), want)
    ok &= torch.equal(ws.dx_slots.cpu(), want)
    ok &= torch.equal(ws.dw_slots.cpu(), mine.float() + 0.5)
    agree(ok, f"combine slots wrong for routing={routing}")


def test_cuda_graph_replays(group):
    """barrier -> pull -> push -> barrier captured once, replayed: same result, epochs advance."""
    ws, prob, sched, _ = _setup("uniform", seed=3)
    rank = ws.rank
    pulled = torch.empty(sched.rows, H, dtype=torch.bfloat16, device=ws.device)

    def step() -> None:
        comm.barrier(ws)
        comm.dispatch_pull(ws, sched, out=pulled)
        comm.combine_push(ws, pulled, sched)
        comm.barrier(ws)

    step()  # compile every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL's watchdog thread
        step()
    ok = True
    want = prob.x[rank].repeat_interleave(K, dim=0)  # slot t*K+k holds x[t]
    for _ in range(3):
        ws.combine_buffer.fill_(float("nan"))
        before = ws.epochs[0].item()
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(ws.combine_buffer.cpu(), want)
        ok &= ws.epochs[0].item() == before + 2
        dist.barrier()
    check_errors(ws)
    agree(ok, "graph replay gave a different combine buffer or epoch")


def test_watchdog_raises_instead_of_hanging(group):
    ws = get_workspace(group, 8, 64, 2, backward=False)  # its own pads: the main ones stay in step
    rank = ws.rank
    message = ""
    if rank == 0:  # rank 0 enters a barrier no one else joins
        comm.barrier(ws, budget=1 << 12)
        torch.cuda.synchronize()
        try:
            check_errors(ws)
        except StallError as e:
            message = str(e)
    dist.barrier()
    torch.cuda.synchronize()
    if rank != 0:  # the late ranks catch up: rank 0's signal is already there
        comm.barrier(ws, budget=1 << 12)
    comm.barrier(ws)  # and the group is in step again
    torch.cuda.synchronize()
    late_ok = True
    try:
        check_errors(ws)
    except StallError as e:
        late_ok, message = False, str(e)
    want = "rank 0 stalled in barrier (index 0) waiting for peer 1"
    agree(late_ok and (rank != 0 or want in message), f"stall message: {message!r}")


def test_bench_comm_smoke(group):
    records = bench_comm(
        group,
        tokens=256,
        hidden=1024,
        top_k=4,
        local_experts=4,
        programs=(4,),
        tile_kb=(64,),
        num_warps=(8,),
        iters=2,
        warmup=1,
    )
    ok = {r["op"] for r in records} == {"dispatch", "combine", "dispatch_dy"}
    ok &= all(r["gbps"] > 0 for r in records)
    ok &= all(r["bitwise_same_as_16_programs"] for r in records if r["op"] == "dispatch")
    agree(ok, f"bench records: {records}")
