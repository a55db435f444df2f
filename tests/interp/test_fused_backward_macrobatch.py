"""The fused backward after a bounded ring, macrobatch by macrobatch, under the CPU interpreter
(docs/fused.md, "Backward", "A bounded ring: one macrobatch at a time").

The layout's rows are cut into host-known windows of the ring's rows; each is replayed
(gather or pull, gate/up + SwiGLU, down) and differentiated by one fused launch whose
weight-gradient tiles continue in fp32 carries. Checked: every gradient bitwise equal to backend
"triton"'s for rings of 1, 2 and 3 row blocks and of every row (one window), with experts
without rows, an expert straddling several windows (up to 5), consecutive windows each with
one expert carried in and another out, padding rows, windows past the used rows,
a shared expert or none, stacked gate/up weights and a K step below the block rows (poisoned
buffers: an element no launch wrote stays NaN), at W = 1 and at W = 2 and 3 emulated in
lockstep (poisoned d_x / d_w slots), and after a capacity overflow (NaN, zeros, the error); the
launches' windows; the carries' two slots; the carry words' sequence per expert (the slots
alternate: a carry in reads what the window before wrote, no window reads the slot it writes)
and the window's expert range; no routed activation buffer of more than the ring's rows and no
fp32 buffer of every expert's weight gradients allocated during the backward (and the full
replay does allocate the former); bad arguments refused by name.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megamoe.backends import fused as fused_backend
from megamoe.backends import steps
from megamoe.backends import triton as backend
from megamoe.ep.workspace import check_errors, local_workspace
from megamoe.errors import CapacityError
from megamoe.kernels import fused as ff
from megamoe.kernels import gemm, rows
from megamoe.kernels.fused.backward import Macrobatch, carry_words, macrobatch_outputs
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.kernels.schedule import build_row_schedule, max_rows, row_window
from megamoe.types import ExpertWeights
from support.bits import assert_same_grads, used_rows
from support.lockstep import ep_step, lockstep
from support.problems import Case, make_problem, stacked_gate_up


@pytest.fixture(autouse=True)
def fused_backward_on(monkeypatch) -> None:
    monkeypatch.setenv(fused_backend.FUSED_BACKWARD_ENV, "1")


@pytest.fixture
def launches(monkeypatch) -> list:
    """(window rows, macrobatch) of each fused backward launch of the backend."""
    calls = []
    launch = fused_backend.fused_backward

    def recorded(ws, sched, *args, **kwargs):
        calls.append((sched.rows, kwargs.get("macrobatch")))
        return launch(ws, sched, *args, **kwargs)

    monkeypatch.setattr(fused_backend, "fused_backward", recorded)
    return calls


def _step(p, weights: ExpertWeights, mod, drop_routed: bool = False):
    """Schedule, forward, backward of backend ``mod`` under poisoned buffers: (ctx, grads).
    ``drop_routed``: the backward gets the context without its routed rows (as after a
    bounded ring), whatever the forward kept."""
    x, ids, w, dy = p.single
    with poisoned_buffers():
        sched = mod.build_schedule(ids, p.config, None)
        _, ctx = mod.forward(x, ids, w, weights, p.config, None, sched)
        if drop_routed:
            ctx = dataclasses.replace(ctx, routed=None)
        return ctx, mod.backward(ctx, dy)


# (case, seed, ring in row blocks (None: the forward keeps every row and the backward gets the
# context without them: one window of every row), stacked gate/up). T48-E6 empty_experts: only
# experts 0-2 get rows (expert 0: 3 row blocks, so it straddles 3, 2 and 1 windows of 1, 2, 3
# blocks), padding rows in its last block and windows past the used rows. B64: the weight
# gradients' K step (32) is below the block rows. T70 one_expert: expert 0 has 5 row blocks (it
# spans 5 windows of 1 block: both carry slots alternate, its middle windows take and leave a
# carry), experts 1-3 2 each (in windows of 2 blocks consecutive windows each take one expert's
# carry and leave another's).
EMPTY = Case(48, 64, 40, 6, 2, shared=16, routing="empty_experts")
ONE = Case(70, 64, 40, 4, 2, routing="one_expert")
CASES = [
    (EMPTY, 3, 1, False),
    (EMPTY, 3, 2, True),
    (EMPTY, 3, 3, False),
    (EMPTY, 3, None, False),
    (Case(29, 64, 40, 4, 2, routing="zipf"), 17, 2, False),
    (Case(50, 64, 48, 4, 2, shared=24, routing="zipf", block_rows=64), 23, 1, False),
    (ONE, 4, 1, False),
    (ONE, 4, 2, False),
]


def _straddling(sched, window: int) -> list[int | None]:
    """Per boundary between windows of ``window`` rows: the expert whose real rows lie on both
    sides of it (its tiles carry across it), else None."""
    starts, counts = sched.row_start.tolist(), sched.counts.tolist()
    out = []
    for b in range(window, sched.rows, window):
        e = [e for e, (a, n) in enumerate(zip(starts, counts)) if a < b < a + n]
        out.append(e[0] if e else None)
    return out


@pytest.mark.parametrize(
    "case,seed,ring_blocks,stacked", CASES, ids=lambda v: getattr(v, "id", str(v))
)
def test_macrobatch_backward_is_bitwise_triton(
    case: Case, seed: int, ring_blocks: int | None, stacked: bool, launches
) -> None:
    bm = case.block_rows
    ring = None if ring_blocks is None else ring_blocks * bm
    p = make_problem(case, seed, minibatch_rows=bm, ring_rows=ring)
    weights = stacked_gate_up(p.weights) if stacked else p.weights
    ctx_ref, g_ref = _step(p, weights, backend)
    ctx, g = _step(p, weights, fused_backend, drop_routed=ring is None)
    assert_same_grads(g, g_ref, case.id)
    check_errors(local_workspace(case.tokens, case.hidden, case.top_k, torch.bfloat16, g.x.device))

    sched = ctx.schedule.routed
    assert torch.equal(sched.row_start, ctx_ref.schedule.routed.row_start)
    window = sched.rows if ring is None else ring
    assert ctx.routed is None
    # the launches: one per window of the layout's rows, in order, each of at most the ring
    firsts = list(range(0, sched.rows, window))
    assert [rows for rows, _ in launches] == [min(window, sched.rows - f) for f in firsts]
    assert [mb.first_row for _, mb in launches] == firsts
    assert all(mb.layout is sched for _, mb in launches)
    # the case is what it means to be
    starts, counts = sched.row_start.tolist(), sched.counts.tolist()
    spans = [len({r // window for r in range(a, b)}) for a, b in zip(starts, starts[1:])]
    if case is EMPTY:
        assert 0 in counts and any(c % bm for c in counts), "experts without rows, padding"
    if case is EMPTY and ring is not None:
        assert max(spans) == (3 if window == bm else 2), spans
        assert used_rows(sched) + window <= sched.rows, "meant to have a window past the used"
    if case is ONE:
        straddle = _straddling(sched, window)
        if ring_blocks == 1:
            assert max(spans) >= 4 and straddle[:4] == [0] * 4, (spans, straddle)
        else:  # windows 2 and 3: one expert's carry in, another's out
            assert straddle[1:4] == [0, 1, 2], straddle
    if stacked:
        assert g.w_gate.data_ptr() + case.intermediate * case.hidden * 2 == g.w_up.data_ptr()
    # the carries: two slots of each routed weight gradient, whatever the number of experts
    carries = launches[0][1].outputs.carries
    shapes = [(2, *getattr(weights, n).shape[1:]) for n in ("w_gate", "w_up", "w_down")]
    assert [(tuple(c.shape), c.dtype) for c in carries] == [(s, torch.float32) for s in shapes]
    if case is ONE:  # both slots of every tile written (allocated poisoned: NaN until then)
        assert not any(c.isnan().any() for c in carries)


def _slots(word: int) -> tuple[int, int]:
    """(the carry slot a tile of this word reads, the one it writes), as ``gemm.wgrad_tile``."""
    out = 1 if word & int(gemm.CARRY_SLOT) else 0
    return 1 - out, out


def test_carry_words_chain_every_tile_across_the_windows() -> None:
    """Per expert, over the windows in order: the active ones are consecutive and hold exactly
    the rows its tiles sum, the first starts from +0, each later one takes the carry from the
    slot the window before left it in, the last one stores the gradient; an expert without
    rows is active once, storing +0. Per window the active experts are consecutive, from the
    first one the words name, as many as they say; at most one carries in and one out, and the
    slot read is never the slot written (the experts of 2 blocks after one of 5 make consecutive
    windows of 2 blocks each carry one expert in and another out; the one of 5 blocks spans up
    to 5 windows)."""
    gen = torch.Generator().manual_seed(5)
    bm = 16
    counts = {0: 70, 2: 20, 4: 25, 5: 30}  # 5, 2, 2 and 2 blocks
    ids = torch.cat([torch.full((n,), e, dtype=torch.int64) for e, n in counts.items()])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].view(-1, 1)  # experts 1, 3 empty
    sched = build_row_schedule(ids, 6, bm)
    starts, counts = sched.row_start.tolist(), sched.counts.tolist()
    spans_max, both = 0, 0  # (the case is what it means to be)
    for bk in (8, 16):
        for window in (16, 32, 48):
            firsts = range(0, sched.rows, window)
            words = [carry_words(sched, j, window, bk) for j in range(len(firsts))]
            for j, (f, w) in enumerate(zip(firsts, words)):
                active = [e for e in range(6) if int(w[e]) & int(gemm.CARRY_ACTIVE)]
                lo, n = int(w[6]), int(w[7])
                what = (bk, window, f, w.tolist())
                assert active == list(range(lo, lo + n)), what
                ins = [e for e in active if int(w[e]) & int(gemm.CARRY_IN)]
                outs = [e for e in active if int(w[e]) & int(gemm.CARRY_OUT)]
                assert len(ins) <= 1 and len(outs) <= 1, what
                # window j writes slot j % 2 and reads the other one
                assert all(_slots(int(w[e])) == (1 - j % 2, j % 2) for e in active), what
                both += len(ins) == len(outs) == 1 and ins != outs
            for e in range(6):
                begin = starts[e]
                end = min(begin + -(-counts[e] // bk) * bk, starts[e + 1])
                seq = [int(w[e]) for w in words]
                act = [i for i, w in enumerate(seq) if w & int(gemm.CARRY_ACTIVE)]
                what = f"bk {bk}, window {window}, expert {e}: {seq}"
                if end == begin:
                    assert act == [min(begin // window, len(seq) - 1)], what
                    assert seq[act[0]] & ~int(gemm.CARRY_SLOT) == int(gemm.CARRY_ACTIVE), what
                    continue
                assert act == list(range(begin // window, (end - 1) // window + 1)), what
                spans_max = max(spans_max, len(act))
                for i in act:
                    assert bool(seq[i] & int(gemm.CARRY_IN)) == (i != act[0]), what
                    assert bool(seq[i] & int(gemm.CARRY_OUT)) == (i != act[-1]), what
                    if i != act[0]:  # takes the carry where the window before left it
                        assert _slots(seq[i])[0] == _slots(seq[i - 1])[1], what
                assert all(seq[i] == 0 for i in range(len(seq)) if i not in act), what
    assert spans_max == 5 and both >= 3, (spans_max, both)


def test_row_window_is_the_layouts_rows() -> None:
    p = make_problem(EMPTY, 3)
    sched = backend.build_schedule(p.single[1], p.config, None).routed
    rows = sched.rows
    for first, n in ((0, 32), (32, 48), (rows - 16, 16)):
        win = row_window(sched, first, n)
        assert torch.equal(win.row_src, sched.row_src[first : first + n])
        assert torch.equal(win.block_expert, sched.block_expert[first // 16 : (first + n) // 16])
        used = used_rows(sched)
        assert int(win.num_blocks) == max(0, min(n, used - first)) // 16
        inside = (sched.dest_row >= first) & (sched.dest_row < first + n)
        assert torch.equal(win.dest_row[inside], sched.dest_row[inside] - first)
        assert (win.dest_row[~inside] == -1).all()
        real = torch.zeros(rows, dtype=torch.bool)
        real[sched.dest_row[sched.dest_row >= 0].long()] = True
        lo = (sched.row_start[:-1] - first).clamp(0, n)
        assert torch.equal(win.row_start[:-1], lo)
        for e in range(sched.num_experts):
            a, b = int(sched.row_start[e]), int(sched.row_start[e + 1])
            assert int(win.counts[e]) == int(real[max(a, first) : min(b, first + n)].sum())
    for first, n in ((8, 16), (0, 0), (rows - 16, 32)):
        with pytest.raises(ValueError, match="a row window must be whole blocks of 16 rows"):
            row_window(sched, first, n)


class _Allocations(TorchDispatchMode):
    """Records the shape of every tensor an op returns in memory of its own (not a view or a
    rebinding of an input's storage, as the interpreter's argument handling makes)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[torch.dtype] = []  # (of each of ``shapes``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.append(tuple(t.shape))
                self.dtypes.append(t.dtype)
        return out


def _routed_shapes(shapes, case: Case, ring: int) -> list[tuple[int, ...]]:
    """The recorded [rows, H] / [rows, I] tensors of more than ``ring`` rows."""
    widths = (case.hidden, case.intermediate)
    return [s for s in shapes if len(s) == 2 and s[1] in widths and s[0] > ring]


def test_routed_buffers_never_exceed_the_ring() -> None:
    """With a ring of a quarter of the rows, nothing of more than the ring's rows and a
    routed activation's width is made during the backward but the layout's d_x rows (the
    combine's input, as the forward's combine buffer); the full replay makes several. The fp32
    tensors shaped like the routed weights: the carries' two slots of each, nothing of every
    expert (the gradients themselves are bf16)."""
    case = Case(48, 64, 40, 6, 2, shared=24, routing="empty_experts")
    bm = case.block_rows
    rows = max_rows(case.tokens * case.top_k, case.experts, bm)
    ring = rows // 4
    assert ring % bm == 0 and case.tokens <= ring
    p = make_problem(case, 31, minibatch_rows=bm, ring_rows=ring)
    x, ids, w, dy = p.single
    sched = fused_backend.build_schedule(ids, p.config, None)
    assert sched.routed.rows == rows and used_rows(sched.routed) > ring
    _, ctx = fused_backend.forward(x, ids, w, p.weights, p.config, None, sched)
    assert ctx.routed is None
    assert fused_backend.macrobatch_rows(ctx.schedule.config, rows) == ring
    with _Allocations() as rec:
        grads = fused_backend.backward(ctx, dy)
    big = _routed_shapes(rec.shapes, case, ring)
    assert big == [(rows, case.hidden)], big
    h, i = case.hidden, case.intermediate
    weight_like = [
        s
        for s, dt in zip(rec.shapes, rec.dtypes)
        if dt == torch.float32 and len(s) == 3 and s[1:] in ((i, h), (h, i))
    ]
    assert case.experts > 2 and sorted(weight_like) == sorted([(2, i, h)] * 2 + [(2, h, i)])
    _, g_ref = _step(p, p.weights, backend)
    assert_same_grads(grads, g_ref, "ring of a quarter")
    # the check can fail: the replay of every row makes xs, g, u, h, z of every row
    with _Allocations() as rec:
        steps.drain(steps.replay_steps(ctx))
    assert len(_routed_shapes(rec.shapes, case, ring)) >= 5


# ------------------------------------------------------------------------------ W > 1

# (case, seed, ring in row blocks): zipf, a shared expert, experts without rows, W = 2 and 3.
EP_CASES = [
    (Case(13, 64, 40, 4, 2, shared=32, routing="zipf", world=2), 7, 1),
    (Case(9, 64, 32, 6, 2, shared=24, routing="zipf", world=3), 8, 2),
]


@pytest.mark.parametrize("case,seed,ring_blocks", EP_CASES, ids=lambda v: getattr(v, "id", v))
def test_ep_macrobatch_backward_is_bitwise_triton(
    case: Case, seed: int, ring_blocks: int, monkeypatch
) -> None:
    """At W > 1 each rank replays (pulls) and differentiates its layout window by window, one
    fused launch (dy pull, dz, d_x push inside) per window: every gradient of every rank
    bitwise backend "triton"'s (d_x and d_w slots poisoned: a row nobody pushed stays NaN), and
    no routed buffer of more than the ring's rows made during the backward."""
    bm = case.block_rows
    ring = ring_blocks * bm
    p = make_problem(case, seed, minibatch_rows=bm, ring_rows=ring)
    with poisoned_buffers():
        ref, scheds, wss = ep_step(p)
    calls: list = []
    launch = fused_backend.fused_backward_ep

    def recorded(ws, sched, *args, **kwargs):
        calls.append((ws.rank, sched.rows, kwargs["macrobatch"].first_row))
        return launch(ws, sched, *args, **kwargs)

    monkeypatch.setattr(fused_backend, "fused_backward_ep", recorded)
    with poisoned_buffers():
        outs = lockstep(
            [
                fused_backend.forward_steps(r.x, r.topk_weights, p.local_weights(i), s)
                for i, (r, s) in enumerate(zip(p.ranks, scheds))
            ],
            wss,
        )
        ctxs = [ctx for _, ctx in outs]
        assert all(c.routed is None for c in ctxs), "meant to drop the routed rows"
        for ws in wss:
            ws.dx_slots.fill_(float("nan"))
            ws.dw_slots.fill_(float("nan"))
        with _Allocations() as rec:
            grads = lockstep(
                [fused_backend.backward_steps(c, r.grad_y) for c, r in zip(ctxs, p.ranks)], wss
            )
    for ws in wss:
        check_errors(ws)
    # nothing of a routed width and more than the ring's rows (d_x rows go out by window)
    assert case.tokens <= ring and not _routed_shapes(rec.shapes, case, ring), rec.shapes
    for r, (g, (_, _, g_ref)) in enumerate(zip(grads, ref)):
        assert_same_grads(g, g_ref, f"rank {r} of {case.world}")
    for r, s in enumerate(scheds):
        rows = s.routed.rows
        expected = [(r, min(ring, rows - f), f) for f in range(0, rows, ring)]
        assert [c for c in calls if c[0] == r] == expected, f"rank {r}'s launches"
    assert any(used_rows(s.routed) > ring for s in scheds), "meant to use several windows"


def test_ep_capacity_overflow_with_a_bounded_ring_gives_nan_like_triton() -> None:
    """An overflowed schedule has no routed rows: every window is empty, d_x and d
    topk_weights NaN on every rank, the weight gradients "triton"'s (zeros: every expert's tiles
    store +0 once), a CapacityError at the check."""
    case = Case(13, 64, 32, 4, 2, shared=32, routing="one-rank", world=2)
    p = make_problem(case, 5, minibatch_rows=16, ring_rows=16, capacity_factor=1.25)
    with poisoned_buffers():
        ref, scheds, wss = ep_step(p)
        outs = lockstep(
            [
                fused_backend.forward_steps(r.x, r.topk_weights, p.local_weights(i), s)
                for i, (r, s) in enumerate(zip(p.ranks, scheds))
            ],
            wss,
        )
        grads = lockstep(
            [fused_backend.backward_steps(c, r.grad_y) for (_, c), r in zip(outs, p.ranks)], wss
        )
    for r in range(case.world):
        assert outs[r][1].routed is None and scheds[r].invalid.tolist() == [1]
        assert grads[r].x.isnan().all() and grads[r].topk_weights.isnan().all(), f"rank {r}"
        for name in ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"):
            assert torch.equal(getattr(grads[r], name), getattr(ref[r][2], name)), name
        with pytest.raises(CapacityError):
            backend.check(scheds[r])


def test_bad_macrobatch_arguments_are_refused() -> None:
    p = make_problem(Case(29, 64, 40, 4, 2), 2)
    x, ids, w, dy = p.single
    sched = backend.build_schedule(ids, p.config, None).routed
    ws = local_workspace(29, 64, 2, torch.bfloat16, x.device)
    wts = p.weights
    window = row_window(sched, 16, 32)
    rows_ = [torch.zeros(32, n, dtype=torch.bfloat16) for n in (64, 64, 40, 40, 40)]
    outs = macrobatch_outputs(sched, 32, wts.w_gate, wts.w_up, wts.w_down, torch.bfloat16)
    outs_64 = macrobatch_outputs(sched, 64, wts.w_gate, wts.w_up, wts.w_down, torch.bfloat16)
    not_a_window = "with 32 rows must be a window of the outputs' {} ring rows"
    launch = (ws, window, *rows_[:1], *rows_[1:], wts.w_gate, wts.w_up, wts.w_down)
    for mb, match in (
        (Macrobatch(outs, sched, 8), "macrobatch first_row 8 with 32 rows must be whole 16-row"),
        (Macrobatch(outs, sched, sched.rows - 16), "inside the layout's"),
        (
            Macrobatch(dataclasses.replace(outs, dg=outs.dg[:16]), sched, 16),
            "macrobatch outputs hold 16 window rows",
        ),
        (Macrobatch(outs, sched, 16), "first_row 16 " + not_a_window.format(32)),
        (Macrobatch(outs_64, sched, 0), "first_row 0 " + not_a_window.format(64)),
    ):
        with pytest.raises(ValueError, match=match):
            ff.fused_backward(*launch, group_rows=16, macrobatch=mb)
    with pytest.raises(ValueError, match=r"g must be a contiguous torch.bfloat16 \[32, 40\]"):
        gemm.gate_up(rows_[1], wts.w_gate, wts.w_up, window, out=(rows_[0],) * 3)
    with pytest.raises(ValueError, match=r"dw must be a contiguous torch.float32 \[29, 2\]"):
        bf16 = torch.zeros(29, 2, dtype=torch.bfloat16)
        rows.route_grad(dy, rows_[0], p.topk_weights.view(-1), window, dw=bf16)
    bad = types.SimpleNamespace(ring_rows=24, block_rows=16)
    with pytest.raises(ValueError, match="ring_rows must be a multiple of block_rows"):
        fused_backend.macrobatch_rows(bad, 96)
