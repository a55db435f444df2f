"""Backend "triton" under the Triton interpreter on the CPU: every kernel, tiny shapes.

The same kernel source as on the GPU runs here with fp32 copies of bf16 tiles (the interpreter
cannot do bf16 math). Outputs and all gradients are checked against the float64 reference, with
every buffer poisoned so unwritten elements or leaking padding rows fail the test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.backends import triton as backend
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.kernels.schedule import build_row_schedule
from support.oracle import compare, reference_grads, run_backend
from support.problems import Case, make_problem, params

CPU = torch.device("cpu")

CASES = [
    Case(37, 64, 96, 4, 2, shared=64),
    Case(29, 64, 64, 6, 2, routing="empty_experts"),
    Case(41, 64, 64, 3, 2, shared=32, routing="one_expert", block_rows=32),
    Case(23, 96, 64, 5, 3, routing="zipf"),
    Case(1, 64, 32, 4, 2, shared=32),  # a single token
    Case(27, 72, 40, 3, 2, shared=24),  # sizes that are not tile multiples
]


@pytest.mark.parametrize("case", params(*CASES))
def test_matches_the_float64_reference(case: Case) -> None:
    p = make_problem(case, seed=CASES.index(case))
    compare(run_backend(p), reference_grads(p, torch.float64), reference_grads(p, torch.bfloat16))


def test_int32_ids_and_bitwise_repeat() -> None:
    p = make_problem(Case(19, 64, 64, 4, 2, shared=32), seed=7, ids_dtype=torch.int32)
    y1, g1 = run_backend(p)
    y2, g2 = run_backend(p)
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    compare((y1, g1), reference_grads(p, torch.float64), reference_grads(p, torch.bfloat16))


@pytest.mark.parametrize("routing", ["uniform", "empty_experts", "one_expert"])
def test_schedule_layout(routing: str) -> None:
    t, e, k, bm = 53, 7, 3, 16
    p = make_problem(Case(t, 64, 64, e, k, routing=routing, block_rows=bm), seed=3)
    with poisoned_buffers():
        s = build_row_schedule(p.topk_ids, e, bm)
    flat = p.topk_ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + bm - 1) // bm * bm
    starts = torch.cumsum(padded, 0) - padded
    assert torch.equal(s.counts.long(), counts)
    assert torch.equal(s.row_start.long(), torch.cat([starts, padded.sum().view(1)]))
    assert s.num_blocks.item() == padded.sum().item() // bm
    used = int(padded.sum())
    for ex in range(e):
        slots = (flat == ex).nonzero().flatten()  # global (token, k) order
        r0 = int(starts[ex])
        rows = torch.arange(r0, r0 + len(slots))
        assert torch.equal(s.dest_row[slots].long(), rows)
        assert torch.equal(s.row_src[rows].long(), slots)
        assert (s.row_src[r0 + len(slots) : r0 + int(padded[ex])] == -1).all()
        assert (s.block_expert[r0 // bm : (r0 + int(padded[ex])) // bm] == ex).all()
    assert (s.block_expert[used // bm :] == -1).all()


def test_schedule_of_one_rank_among_several() -> None:
    """Expert-parallel form: only ids in [expert_lo, expert_lo + E) are placed; slots carry the
    source rank's offset."""
    t, k, e_local, bm, rank = 31, 2, 3, 16, 1
    ids = torch.stack([torch.randperm(9)[:k] for _ in range(t)])
    with poisoned_buffers():
        s = build_row_schedule(ids, e_local, bm, expert_lo=3, rank=rank)
    flat = ids.reshape(-1)
    local = (flat >= 3) & (flat < 6)
    assert (s.dest_row[~local] == -1).all()
    assert torch.equal(s.counts.long(), torch.bincount(flat[local] - 3, minlength=e_local))
    placed = s.dest_row[local].long()
    assert torch.equal(s.row_src[placed].long(), local.nonzero().flatten() + rank * t * k)


def test_world_size_above_one_needs_a_process_group() -> None:
    """W > 1 builds the symmetric workspace: without torch.distributed it says so clearly."""

    class FakeGroup:  # only asked for its size
        pass

    import torch.distributed as dist

    cfg = Case(4, 64, 64, 4, 2).config()
    orig = dist.get_world_size
    dist.get_world_size = lambda group=None: 2  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="process group"):
            backend.build_schedule(torch.zeros((4, 2), dtype=torch.int64), cfg, FakeGroup())
    finally:
        dist.get_world_size = orig  # type: ignore[assignment]


def test_cpu_is_not_offered_as_a_backend() -> None:
    """The interpreter is for tests: backend="auto" must not pick it on the CPU."""
    ok, reason = backend.is_available(CPU)
    assert not ok and "interpreter" in reason


def test_gemm_grid_size_never_changes_bits() -> None:
    """Every GEMM with a smaller grid (the shared expert beside the copies uses SMs - copy
    programs) walks the same tiles with the same K loop: identical bits, every tile written."""
    from megamoe.kernels import gemm

    p = make_problem(Case(29, 64, 96, 4, 2), seed=11)
    sched = build_row_schedule(p.topk_ids, 4, 16)
    w = p.weights
    gen = torch.Generator().manual_seed(3)
    xs = torch.randn(sched.rows, 64, generator=gen).to(torch.bfloat16)
    dz = torch.randn(sched.rows, 64, generator=gen).to(torch.bfloat16)

    def every_gemm(programs):
        with poisoned_buffers():
            g, u, h = gemm.gate_up(xs, w.w_gate, w.w_up, sched, programs)
            z = gemm.grouped_mm(h, w.w_down, sched, programs)
            dg, du = gemm.dgrad_swiglu(dz, w.w_down, g, u, sched, programs)
            dx = gemm.dgrad_pair(dg, w.w_gate, du, w.w_up, sched, programs)
            return g, u, h, z, dg, du, dx, gemm.wgrad(dg, xs, sched, programs)

    used = int(sched.num_blocks.item()) * sched.block_rows
    default = every_gemm(None)
    for out in default[:-1]:
        assert not out[:used].isnan().any()  # poisoned with NaN: every used row was written
    assert not default[-1].isnan().any()
    for programs in (1, 3):
        for a, b in zip(default, every_gemm(programs)):
            assert torch.equal(
                a[:used] if a.shape[0] == sched.rows else a,
                b[:used] if b.shape[0] == sched.rows else b,
            )
    with pytest.raises(ValueError, match="programs must be >= 1, got 0"):
        gemm.grouped_mm(xs, w.w_down, sched, 0)


def test_weight_gradient_skips_the_padding_past_the_last_k_step() -> None:
    """The weight gradient sums an expert's rows up to its last real row rounded up to the K
    step, not to the end of its padded block: the same bits as summing every padding row
    (zeros), and the float64 product of the real rows."""
    import dataclasses

    from megamoe.kernels import gemm

    p = make_problem(Case(50, 64, 96, 4, 2, routing="zipf"), seed=23)
    sched = build_row_schedule(p.topk_ids, 4, 64)  # K step 32 in 64-row blocks
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(sched.rows, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(sched.rows, 64, generator=gen).to(torch.bfloat16)
    real = sched.row_src >= 0
    a[~real], b[~real] = 0, 0  # (the layout's padding rows hold zeros)
    padded = (sched.row_start[1:] - sched.row_start[:-1]).to(torch.int32)
    skips = ((padded - sched.counts) >= 32).any()
    assert skips, "the case must have an expert whose padding spans a whole K step"
    with poisoned_buffers():
        got = gemm.wgrad(a, b, sched)
        every_row = gemm.wgrad(a, b, dataclasses.replace(sched, counts=padded))
    assert not got.isnan().any()
    assert torch.equal(got, every_row)
    for e in range(4):
        lo, hi = int(sched.row_start[e]), int(sched.row_start[e + 1])
        want = a[lo:hi].double().T @ b[lo:hi].double()
        torch.testing.assert_close(got[e].double(), want, rtol=1e-2, atol=1e-2)


def test_flattened_weight_gradient_keeps_the_bits(monkeypatch) -> None:
    """``GemmTiles.flatten``: the weight gradient as one loop over all of a program's K steps
    (the pipeline runs on from tile to tile) gives the tile loop's bits for any grid (one
    program: every tile in one loop), stops at each expert's last real row as the tile loop
    does, writes expert 2 (no rows) as zeros, and walks experts of unequal K steps."""
    from megamoe.kernels import gemm

    gen = torch.Generator().manual_seed(7)
    experts = torch.tensor([0, 1, 3])
    ids = torch.stack([experts[torch.randperm(3, generator=gen)[:2]] for _ in range(37)])
    sched = build_row_schedule(ids, 4, 64)  # K step 32 in 64-row blocks
    a = torch.randn(sched.rows, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(sched.rows, 64, generator=gen).to(torch.bfloat16)
    real = sched.row_src >= 0
    a[~real], b[~real] = 0, 0
    assert int(sched.counts[2]) == 0
    flat = {
        name: dataclasses.replace(t, flatten=True) if name.startswith("wgrad") else t
        for name, t in gemm.INTERPRETER_TILES.items()
    }

    def check(a, b, sched, what: str) -> torch.Tensor:
        """The tile loop's gradient, after checking the flattened loop's against it."""
        with poisoned_buffers():
            want = gemm.wgrad(a, b, sched)
        with monkeypatch.context() as patch:
            patch.setattr(gemm, "INTERPRETER_TILES", flat)
            for programs in (None, 1, 3):
                with poisoned_buffers():
                    got = gemm.wgrad(a, b, sched, programs)
                assert not got.isnan().any(), (
                    f"a tile was not written ({programs} programs, {what})"
                )
                assert torch.equal(got, want), (
                    f"flattening changed bits ({programs} programs, {what})"
                )
        return want

    want = check(a, b, sched, "random routing")
    assert torch.equal(want[2], torch.zeros_like(want[2]))
    # experts of unequal K steps (the walks count each tile's own): 3, 1, 0 and 2 steps of 32
    ids = torch.cat([torch.full((n,), e) for e, n in ((0, 90), (1, 20), (3, 50))])[:, None]
    sched = build_row_schedule(ids, 4, 64)
    real = (sched.row_src >= 0)[:, None]
    a, b = (torch.randn(sched.rows, n, generator=gen).to(torch.bfloat16) * real for n in (96, 64))
    check(a, b, sched, "unequal steps")


def test_weight_gradient_rule_by_rows_per_expert_keeps_the_bits(monkeypatch) -> None:
    """The weight gradient's tiles are chosen by the balanced rows per expert
    (``gemm.wgrad_kind``); both choices give the same bits, every element written."""
    from megamoe.kernels import gemm

    p = make_problem(Case(40, 64, 96, 4, 2), seed=21)
    sched = build_row_schedule(p.topk_ids, 4, 16)
    assert gemm.wgrad_kind(sched) == "wgrad_few_rows"  # 40 * 2 / 4 = 20 rows per expert
    tiles = dict(gemm.INTERPRETER_TILES)
    tiles["wgrad_few_rows"] = dataclasses.replace(tiles["wgrad"], bm=16, bn=64, programs_per_sm=2)
    monkeypatch.setattr(gemm, "INTERPRETER_TILES", tiles)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(sched.rows, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(sched.rows, 64, generator=gen).to(torch.bfloat16)
    with poisoned_buffers():
        few = gemm.wgrad(a, b, sched)
        monkeypatch.setattr(gemm, "FEW_ROWS_PER_EXPERT", 0)
        assert gemm.wgrad_kind(sched) == "wgrad"
        default = gemm.wgrad(a, b, sched)
    assert not few.isnan().any() and not default.isnan().any()
    assert torch.equal(few, default)


@pytest.mark.parametrize("bn, bm, row_bm, per_sm", [(16, 16, 0, 1), (64, 64, 0, 1), (32, 32, 8, 2)])
def test_gemm_tile_width_never_changes_bits(
    monkeypatch, bn: int, bm: int, row_bm: int, per_sm: int
) -> None:
    """The output tile's width and height (a row block split into tiles of ``row_bm`` rows; the
    weight-gradient tile's height) and the programs per SM only split the outputs: each element
    keeps its K loop, so tiles chosen by shape give the same bits. (The K step is not free: it
    orders the accumulation.)"""
    from megamoe.kernels import gemm

    p = make_problem(Case(29, 64, 96, 4, 2), seed=12)  # I = 96: partial 64-wide tiles
    sched = build_row_schedule(p.topk_ids, 4, 16)
    w = p.weights
    gen = torch.Generator().manual_seed(4)
    xs = torch.randn(sched.rows, 64, generator=gen).to(torch.bfloat16)
    dz = torch.randn(sched.rows, 64, generator=gen).to(torch.bfloat16)

    def every_gemm():
        with poisoned_buffers():
            g, u, h = gemm.gate_up(xs, w.w_gate, w.w_up, sched)
            z = gemm.grouped_mm(h, w.w_down, sched)
            dg, du = gemm.dgrad_swiglu(dz, w.w_down, g, u, sched)
            dx = gemm.dgrad_pair(dg, w.w_gate, du, w.w_up, sched)
            return g, u, h, z, dg, du, dx, gemm.wgrad(dg, xs, sched)

    used = int(sched.num_blocks.item()) * sched.block_rows
    default = every_gemm()
    tiles = {
        name: dataclasses.replace(
            t, bn=bn, bm=bm if name.startswith("wgrad") else row_bm, programs_per_sm=per_sm
        )
        for name, t in gemm.INTERPRETER_TILES.items()
    }
    monkeypatch.setattr(gemm, "INTERPRETER_TILES", tiles)
    for i, (a, b) in enumerate(zip(default, every_gemm())):
        if a.shape[0] == sched.rows:
            a, b = a[:used], b[:used]
        assert not b.isnan().any(), f"output {i}: a tile was not written"
        assert torch.equal(a, b), f"output {i} changed with tiles {tiles}"
    bad = {name: dataclasses.replace(t, bm=12) for name, t in tiles.items()}
    monkeypatch.setattr(gemm, "INTERPRETER_TILES", bad)
    with pytest.raises(ValueError, match="bm = 12 must divide block_rows = 16"):
        gemm.grouped_mm(xs, w.w_down, sched)
