"""Communication kernels under the CPU interpreter, with W ranks emulated in one process.

Each emulated rank owns plain tensors; the kernels reach the other ranks through the same peer
address tables as on GPUs. Programs of one launch run in order and launches run one after another,
so barriers are run in phases: every rank arrives, then every rank waits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.ep.workspace import (
    BARRIER_CHANNELS,
    REGION_ALIGN,
    check_errors,
    emulated_workspaces,
    publish,
    publish_packed,
    workspace_bytes,
)
from megamoe.errors import ErrorWord, Stage, StallError
from megamoe.kernels import comm, fp8
from megamoe.kernels.schedule import build_row_schedule

BLOCK_ROWS = 16
# (world, T, H, K, local experts, programs, tile bytes): H=1096 needs two column tasks per row
# (COLS is at most 1024) with the second one masked; tiny tiles give every program several tasks.
CASES = [(2, 10, 40, 2, 3, 3, 256), (3, 7, 1096, 3, 2, 2, 4096)]


def _encode(slot: torch.Tensor, h: int) -> torch.Tensor:
    """Values exact in bf16 that identify a global slot: row s is ((31 s + 7 j) mod 241) - 120."""
    j = torch.arange(h)
    return (((slot[:, None] * 31 + j[None, :] * 7) % 241) - 120).to(torch.bfloat16)


class Cluster:
    """W emulated ranks with random routing, published and exchanged, plus their schedules."""

    def __init__(
        self, world: int, t: int, h: int, k: int, e_local: int, seed: int, skew: bool = False
    ) -> None:
        self.world, self.t, self.h, self.k, self.e_local = world, t, h, k, e_local
        gen = torch.Generator().manual_seed(seed)
        self.ws = emulated_workspaces(world, t, h, k, torch.bfloat16)
        e = e_local * world
        self.x, self.dy, self.ids, self.tw = [], [], [], []
        for r in range(world):
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
            x[:, 0], x[:, 1] = r, torch.arange(t)  # rank-encoded rows: (rank, token) in the row
            self.x.append(x)
            self.dy.append(torch.randn(t, h, generator=gen).to(torch.bfloat16))
            if skew:  # every token to the experts of the last rank; the others get no rows
                ids = torch.stack([torch.randperm(e_local, generator=gen)[:k] for _ in range(t)])
                ids = ids + (world - 1) * e_local
            else:
                ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k]
            self.ids.append(ids)
            self.tw.append(torch.rand(t, k, generator=gen))
            publish(self.ws[r], x=x, topk_ids=ids, topk_weights=self.tw[r], dy=self.dy[r])
        barrier_all(self.ws)
        self.scheds = []
        for r in range(world):
            ids, weights = comm.gather_routing(self.ws[r])
            assert torch.equal(ids, torch.cat(self.ids).to(torch.int32))
            assert torch.equal(weights, torch.cat(self.tw))
            self.scheds.append(build_row_schedule(ids, e_local, BLOCK_ROWS, expert_lo=r * e_local))

    def used_rows(self, r: int) -> int:
        return int(self.scheds[r].num_blocks) * BLOCK_ROWS

    def row_slots(self, r: int) -> torch.Tensor:
        return self.scheds[r].row_src[: self.used_rows(r)].long()


def barrier_all(ws: list, channel: int = 0) -> None:
    for w in ws:
        comm.barrier(w, channel, phase=comm.ARRIVE)
    for w in ws:
        comm.barrier(w, channel, budget=4, phase=comm.WAIT)
    for w in ws:
        check_errors(w)


@pytest.fixture(params=CASES, ids=lambda c: f"W{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}")
def case(request):
    world, t, h, k, e_local, programs, tile = request.param
    return Cluster(world, t, h, k, e_local, seed=world * 100 + h), programs, tile


def test_schedule_partitions_slots(case):
    """Precondition of one-writer combine: every global slot is a row of exactly one rank."""
    cl, _, _ = case
    tk = cl.t * cl.k
    owner = torch.cat(cl.ids).view(-1) // cl.e_local
    seen = torch.zeros(cl.world * tk, dtype=torch.int64)
    for r in range(cl.world):
        slots = cl.row_slots(r)
        real = slots[slots >= 0]
        assert torch.all(owner[real] == r)
        seen.index_add_(0, real, torch.ones_like(real))
    assert torch.all(seen == 1)


def test_dispatch_lands_every_row(case):
    cl, programs, tile = case
    allx = torch.cat(cl.x)
    for r in range(cl.world):
        sched = cl.scheds[r]
        out = torch.full((sched.rows, cl.h), float("nan"), dtype=torch.bfloat16)
        comm.dispatch_pull(cl.ws[r], sched, out=out, programs=programs, tile_bytes=tile)
        used, slots = cl.used_rows(r), cl.row_slots(r)
        real = slots >= 0
        token = (slots % (cl.t * cl.k)) // cl.k
        src = slots // (cl.t * cl.k)
        assert torch.equal(out[:used][real], allx[slots[real] // cl.k])
        assert torch.equal(out[:used][real][:, 0].long(), src[real])  # the row says where from
        assert torch.equal(out[:used][real][:, 1].long(), token[real])
        assert torch.all(out[:used][~real] == 0)  # padding rows are zero-filled
        assert torch.all(out[used:].isnan())  # rows past the used ones are not touched


@pytest.mark.parametrize(
    "world, t, h, k, e_local, programs, tile",
    [(2, 10, 272, 2, 3, 3, 256), (3, 7, 2304, 3, 2, 2, 4096)],  # 144 and 1200 words a row
    ids=["W2-H272", "W3-H2304"],
)
def test_dispatch_moves_packed_fp8_rows_word_for_word(world, t, h, k, e_local, programs, tile):
    """``publish_packed`` quantizes each rank's tokens (and its dy) into its x_buffer (dy_buffer)
    as packed fp8 rows, and the pull with ``packed_width`` lands each token's packed row (its
    fp8 bytes and scales) unchanged in every row routed to it: padding rows zeros, rows past the
    used ones untouched."""
    cl = Cluster(world, t, h, k, e_local, seed=world * 100 + h)
    width = fp8.packed_width(h)
    for ws, x, dy in zip(cl.ws, cl.x, cl.dy):
        publish_packed(ws, x, dy=dy)
    barrier_all(cl.ws)
    for source, values in (("x", cl.x), ("dy", cl.dy)):
        _check_packed_pull(cl, source, values, width, programs, tile)


def _check_packed_pull(cl, source, values, width, programs, tile) -> None:
    h = cl.h
    tokens = fp8.quantize_packed(torch.cat(values))
    for r in range(cl.world):
        sched = cl.scheds[r]
        out = torch.full((sched.rows, width), 0x7F7F, dtype=torch.int16)
        pulled = comm.dispatch_pull(
            cl.ws[r], sched, source, out=out, programs=programs, tile_bytes=tile,
            packed_width=width, scale=False,
        )  # fmt: skip
        assert pulled is out
        used, slots = cl.used_rows(r), cl.row_slots(r)
        real = slots >= 0
        assert torch.equal(out[:used][real], tokens[slots[real] // cl.k])
        assert torch.all(out[:used][~real] == 0)
        assert torch.all(out[used:] == 0x7F7F)
        q, scale = fp8.unpack_rows(out[:used][real], h)
        want_q, want_scale = fp8.quantize_rows(torch.cat(values)[slots[real] // cl.k])
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale, want_scale)


def test_dispatch_of_an_emptied_schedule_writes_nothing(case):
    """After a capacity overflow the schedule has no used rows but its dest_row is stale: the
    token-order pull must not store through it."""
    cl, programs, tile = case
    for r in range(cl.world):
        sched = dataclasses.replace(cl.scheds[r], num_blocks=torch.zeros(1, dtype=torch.int32))
        out = torch.full((sched.rows, cl.h), float("nan"), dtype=torch.bfloat16)
        comm.dispatch_pull(cl.ws[r], sched, out=out, programs=programs, tile_bytes=tile)
        assert torch.all(out.isnan()), f"rank {r}"


def test_dispatch_scaled_dy_bitwise(case):
    cl, programs, tile = case
    alldy, allw = torch.cat(cl.dy), torch.cat(cl.tw).view(-1)
    for r in range(cl.world):
        sched = cl.scheds[r]
        out = comm.dispatch_pull(cl.ws[r], sched, source="dy", programs=programs, tile_bytes=tile)
        used, slots = cl.used_rows(r), cl.row_slots(r)
        real = slots >= 0
        want = (alldy[slots[real] // cl.k].float() * allw[slots[real]][:, None]).to(torch.bfloat16)
        assert torch.equal(out[:used][real], want)
        assert torch.all(out[:used][~real] == 0)


@pytest.mark.parametrize("target", ["combine", "dx"])
def test_push_writes_every_slot_once(case, target):
    cl, programs, tile = case
    tk = cl.t * cl.k
    region = "combine_buffer" if target == "combine" else "dx_slots"
    gen = torch.Generator().manual_seed(7)
    for w in cl.ws:
        getattr(w, region).fill_(float("nan"))
    for r in range(cl.world):
        sched = cl.scheds[r]
        rows = torch.randn(sched.rows, cl.h, generator=gen).to(torch.bfloat16)  # padding: garbage
        slots = cl.row_slots(r)
        real = torch.nonzero(slots >= 0).view(-1)
        rows[real] = _encode(slots[real], cl.h)
        comm.combine_push(cl.ws[r], rows, sched, target=target, programs=programs, tile_bytes=tile)
    barrier_all(cl.ws, channel=1)
    for r, w in enumerate(cl.ws):
        want = _encode(torch.arange(r * tk, (r + 1) * tk), cl.h)
        assert torch.equal(getattr(w, region), want), f"rank {r}"


def test_push_values_writes_every_slot_once(case):
    cl, programs, _ = case
    tk = cl.t * cl.k
    for w in cl.ws:
        w.dw_slots.fill_(float("nan"))
    for r in range(cl.world):
        sched = cl.scheds[r]
        values = torch.rand(sched.rows) - 5.0
        slots = cl.row_slots(r)
        real = torch.nonzero(slots >= 0).view(-1)
        values[real] = slots[real].float() + 0.5
        comm.push_row_values(cl.ws[r], values, sched, programs=programs)
    for r, w in enumerate(cl.ws):
        assert torch.equal(w.dw_slots, torch.arange(r * tk, (r + 1) * tk).float() + 0.5)


def test_skewed_routing_all_to_last_rank():
    cl = Cluster(3, 9, 40, 2, 3, seed=5, skew=True)
    assert [cl.used_rows(r) for r in range(3)][:2] == [0, 0]
    out = comm.dispatch_pull(cl.ws[2], cl.scheds[2], programs=4, tile_bytes=256)
    slots = cl.row_slots(2)
    real = slots >= 0
    assert int(real.sum()) == 3 * 9 * 2
    assert torch.equal(out[: cl.used_rows(2)][real], torch.cat(cl.x)[slots[real] // 2])
    for w in cl.ws:
        w.combine_buffer.fill_(float("nan"))
    for r in range(3):  # ranks with no rows push nothing (and must not fail)
        rows = torch.zeros(cl.scheds[r].rows, 40, dtype=torch.bfloat16)
        real_rows = torch.nonzero(cl.row_slots(r) >= 0).view(-1)
        rows[real_rows] = _encode(cl.row_slots(r)[real_rows], 40)
        comm.combine_push(cl.ws[r], rows, cl.scheds[r], programs=2, tile_bytes=256)
    for r, w in enumerate(cl.ws):
        assert torch.equal(w.combine_buffer, _encode(torch.arange(r * 18, (r + 1) * 18), 40))


def test_barrier_epochs_and_channels():
    ws = emulated_workspaces(3, 4, 8, 2)
    for _ in range(3):
        barrier_all(ws, channel=0)
    barrier_all(ws, channel=5)
    for w in ws:
        assert w.epochs.tolist() == [3, 0, 0, 0, 0, 1, 0, 0]
        want = torch.zeros(BARRIER_CHANNELS, 3, dtype=torch.int32)
        want[0], want[5] = 3, 1
        assert torch.equal(w.signals, want)
        assert not w.errors.any()


def test_watchdog_reports_missing_peer():
    ws = emulated_workspaces(3, 4, 8, 2)
    barrier_all(ws)
    for r in (0, 2):  # rank 1 never arrives at the second barrier
        comm.barrier(ws[r], phase=comm.ARRIVE)
    comm.barrier(ws[0], budget=6, phase=comm.WAIT)
    words = ws[0].errors.tolist()
    assert words[ErrorWord.FLAG] == 1 and words[ErrorWord.STAGE] == Stage.BARRIER
    assert (words[ErrorWord.PEER], words[ErrorWord.RANK], words[ErrorWord.WANTED]) == (1, 0, 2)
    # Rank 2 alone on channel 3 stalls on peer 0; rank 0 then stalls on peer 1 there, but its
    # record keeps the first stall (and, having stalled once, it does not spin again).
    comm.barrier(ws[2], channel=3, budget=3)
    comm.barrier(ws[0], channel=3, budget=3)
    assert ws[0].errors.tolist() == words
    with pytest.raises(StallError, match=r"rank 0 stalled in barrier .*peer 1"):
        check_errors(ws[0])
    check_errors(ws[0])  # cleared
    with pytest.raises(StallError, match=r"rank 2 stalled in barrier \(index 3\).*peer 0"):
        check_errors(ws[2])
    # The late rank catches up: its barrier passes at once, and the group is in step again.
    comm.barrier(ws[1], budget=2)
    comm.barrier(ws[1], channel=3, budget=2)
    check_errors(ws[1])
    barrier_all(ws)
    barrier_all(ws, channel=3)


def test_workspace_layout():
    t, h, k, w = 5, 24, 3, 2
    ws = emulated_workspaces(w, t, h, k)
    names = [
        "x_buffer",
        "combine_buffer",
        "dy_buffer",
        "dx_slots",
        "dw_slots",
        "routing_ids",
        "routing_weights",
        "signals",
        "epochs",
        "errors",
    ]
    spans = []
    for rank_ws in ws:
        base = rank_ws.storage.data_ptr()
        assert rank_ws.storage.numel() == workspace_bytes(t, h, k, w, torch.bfloat16)
        for name in names:
            v = getattr(rank_ws, name)
            assert (v.data_ptr() - base) % REGION_ALIGN == 0, name
            spans.append((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()))
        tables = rank_ws.peers
        for field, name in (
            ("x", "x_buffer"),
            ("combine", "combine_buffer"),
            ("dy", "dy_buffer"),
            ("dx", "dx_slots"),
            ("dw", "dw_slots"),
            ("ids", "routing_ids"),
            ("weights", "routing_weights"),
            ("signals", "signals"),
        ):
            assert getattr(tables, field).tolist() == [getattr(o, name).data_ptr() for o in ws]
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "regions overlap"
    assert ws[0].slots == t * k
    fwd = emulated_workspaces(w, t, h, k, backward=False)[0]
    assert fwd.dy_buffer is None and fwd.dx_slots is None and fwd.dw_slots is None


def test_errors_name_the_argument():
    ws = emulated_workspaces(2, 4, 16, 2)[0]
    with pytest.raises(ValueError, match=r"x must have shape \[4, 16\]"):
        publish(ws, x=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="hidden"):
        emulated_workspaces(2, 4, 12, 2)  # 24 bytes per row: not a multiple of 16
    ids = torch.zeros(8, 2, dtype=torch.int32)
    sched = build_row_schedule(ids, 1, BLOCK_ROWS)
    with pytest.raises(ValueError, match="source must be"):
        comm.dispatch_pull(ws, sched, source="z")
    with pytest.raises(ValueError, match="programs must be"):
        comm.dispatch_pull(ws, sched, programs=0)
    with pytest.raises(ValueError, match="channel must be"):
        comm.barrier(ws, channel=BARRIER_CHANNELS)
    with pytest.raises(ValueError, match="packed_width needs scale=False"):
        comm.dispatch_pull(ws, sched, source="dy", scale=True, packed_width=16)
    with pytest.raises(ValueError, match=r"packed_width must be a multiple of 8 .* \[8, 16\]"):
        comm.dispatch_pull(ws, sched, packed_width=24)
    with pytest.raises(ValueError, match=r"out must be a contiguous \[32, 16\] torch.int16"):
        comm.dispatch_pull(ws, sched, packed_width=16, out=torch.zeros(sched.rows, 16))
    with pytest.raises(ValueError, match=r"x must have shape \[4, 16\]"):
        publish_packed(ws, torch.zeros(4, 32))
    wrong = build_row_schedule(torch.zeros(4, 2, dtype=torch.int32), 1, BLOCK_ROWS)
    with pytest.raises(ValueError, match=r"all ranks' ids \[W\*T, K\] = \[8, 2\]"):
        comm.combine_push(ws, torch.zeros(wrong.rows, 16, dtype=torch.bfloat16), wrong)


def test_bench_problem_on_one_rank():
    """The benchmark's setup path (publish, barrier, routing exchange, schedule) with W=1."""
    from megamoe.tools.bench_comm import remote_rows, routed_problem

    ws = emulated_workspaces(1, 12, 32, 2)[0]
    sched = routed_problem(ws, local_experts=3, block_rows=BLOCK_ROWS)
    assert remote_rows(ws, sched) == 0
    used = int(sched.num_blocks) * BLOCK_ROWS
    slots = sched.row_src[:used].long()
    out = comm.dispatch_pull(ws, sched, programs=2, tile_bytes=512)
    real = slots >= 0
    assert int(real.sum()) == 12 * 2
    assert torch.equal(out[:used][real], ws.x_buffer[slots[real] // 2])
