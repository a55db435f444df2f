"""``MoEConfig(precision="fp8")`` with backend "triton" on one Hopper GPU: the layer against the
float64 layer on the unquantized inputs (the recipe's bars), the same bits run to run, and a
CUDA graph of a training step that quantizes the weights inside the graph, so a replay after an
optimizer step reads the new weights (the weight cache is bypassed while capturing).

Run on the device: ``python -m pytest tests/gpu/test_fp8.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from megamoe import functional  # noqa: E402
from megamoe.backends import fp8_weights  # noqa: E402
from megamoe.kernels.runtime import poisoned_buffers  # noqa: E402
from support.oracle import reference_grads, rel_err  # noqa: E402
from support.problems import Case, make_problem  # noqa: E402

DEV = torch.device("cuda")
FP8 = dict(precision="fp8", minibatch_rows=1024, ring_rows=None)
# a dsv3-like layer (one rank's experts) with a shared expert, tokens sliced for the oracle
CASES = {
    "dsv3": Case(512, 7168, 2048, 32, 8, shared=2048, block_rows=128),
    "qwen3-30b": Case(1000, 2048, 768, 64, 8, block_rows=128),
}
# the recipe's own error against the unquantized float64 layer (tests/interp/test_fp8_layer.py)
Y_REL_L2, GRAD_COSINE = 8e-2, 0.996


def _step(p, weights=None):
    w = [t.clone().requires_grad_(True) for t in (weights or p.weights) if t is not None]
    x = p.x.clone().requires_grad_(True)
    tw = p.topk_weights.clone().requires_grad_(True)
    with poisoned_buffers():
        y = functional.moe(x, p.topk_ids, tw, type(p.weights)(*w), p.config, backend="triton")
        y.backward(p.grad_y)
    return [y.detach(), x.grad, tw.grad, *(t.grad for t in w)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_layer_within_the_recipe_bars_and_reproducible(name: str) -> None:
    p = make_problem(CASES[name], seed=1, device=DEV, **FP8)
    ours = _step(p)
    y64, g64 = reference_grads(p, torch.float64)
    expected = [y64, *(g for g in g64 if g is not None)]
    assert rel_err(ours[0], y64) <= Y_REL_L2, f"y: {rel_err(ours[0], y64):.3e}"
    for i, (a, b) in enumerate(zip(ours[1:], expected[1:])):
        assert torch.isfinite(a).all(), f"grad {i}: not finite"
        cos = torch.nn.functional.cosine_similarity(a.double().flatten(), b.flatten(), dim=0)
        assert cos >= GRAD_COSINE, f"grad {i}: cosine {cos:.5f}"
    again = _step(p)
    for i, (a, b) in enumerate(zip(ours, again)):
        assert torch.equal(a, b), f"output {i} differs run to run"


@pytest.mark.parametrize("bn, row_bm, per_sm", [(64, 0, 1), (128, 64, 2)])
def test_fp8_tiles_never_change_bits(monkeypatch, bn: int, row_bm: int, per_sm: int) -> None:
    """The block-scaled GEMMs give the same bits with other tiles than the defaults (narrower
    output tiles, 64-row tiles of one warpgroup instead of the split 128-row ones, one or two
    programs per SM, the forward down's Triton kernel instead of the warp-specialized one):
    each element's K loop, 128 a step, is the same in every tile."""
    import dataclasses

    from megamoe.kernels import fp8_gemm

    p = make_problem(CASES["qwen3-30b"], seed=2, device=DEV, **FP8)
    default = _step(p)
    tiles = {
        kind: dataclasses.replace(
            t,
            bn=min(t.bn, bn),
            # (the automatic weight gradient, bm 0, as its Triton tiles: 128 rows)
            bm=((t.bm or 128) if row_bm == 0 else row_bm) if kind.startswith("wgrad") else row_bm,
            warps=4 if row_bm == 64 else t.warps,
            programs_per_sm=per_sm,
            split_m=t.split_m if row_bm == 0 else 1,  # (a WGMMA's sub-tile is 64 rows)
            warp_specialized=False,  # (the forward down's Triton kernel against fp8_ws)
        )
        for kind, t in fp8_gemm.GPU_TILES.items()
    }
    monkeypatch.setattr(fp8_gemm, "GPU_TILES", tiles)
    for i, (a, b) in enumerate(zip(default, _step(p))):
        assert torch.equal(a, b), f"output {i} changed with tiles {tiles}"


def test_cuda_graph_quantizes_the_current_weights() -> None:
    p = make_problem(CASES["qwen3-30b"], seed=2, device=DEV, **FP8)
    weights = [t.clone() for t in p.weights if t is not None]
    x, ids, tw = p.x, p.topk_ids, p.topk_weights

    def step():
        return functional.moe(x, ids, tw, type(p.weights)(*weights), p.config, backend="triton")

    step()  # compiles every kernel and fills the weight cache before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    with torch.no_grad():  # an optimizer step, in place
        for w in weights:
            w.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    fp8_weights.clear()
    eager = step()  # quantizes the updated weights afresh
    assert torch.equal(static_y, eager), "the replay used stale quantized weights"


def test_fsdp2_sharded_layer_reads_each_steps_weights(tmp_path) -> None:
    """``fully_shard`` on one rank: FSDP2 writes each all-gather into the unsharded weights with
    their versions kept and frees them after the forward, and the CUDA allocator may hand the
    address back. Every step's output and input gradient are those of an unsharded layer with
    the same weights and optimizer, never those of stale fp8 copies."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import megamoe

    p = make_problem(CASES["qwen3-30b"], seed=3, device=DEV, **FP8)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        sharded = megamoe.MoE(p.config, backend="triton", device=DEV, seed=4)
        plain = megamoe.MoE(p.config, backend="triton", device=DEV, seed=4)
        fully_shard(sharded, mesh=init_device_mesh("cuda", (1,)))
        opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (sharded, plain)]
        outs = []
        for step in range(3):
            ys = []
            for moe, opt in zip((sharded, plain), opts):
                x = p.x.clone().requires_grad_(True)
                y = moe(x, p.topk_ids, p.topk_weights)
                y.backward(p.grad_y)
                opt.step()
                opt.zero_grad(set_to_none=True)
                ys.append((y.detach(), x.grad))
            (ya, dxa), (yb, dxb) = ys
            assert rel_err(ya, yb) < 1e-3 and rel_err(dxa, dxb) < 1e-3, step
            outs.append(yb)
        assert rel_err(outs[1], outs[0]) > 1e-2  # (a step moves the weights about 5%)
    finally:
        dist.destroy_process_group()


def _routed_rows(experts: int, seed: int):
    """A schedule of 1500 tokens, top-2, 128-row blocks, expert 1 without rows and the others
    unevenly loaded; its used rows; each used row's expert."""
    from megamoe.kernels.schedule import build_row_schedule

    gen = torch.Generator(device=DEV).manual_seed(seed)
    choice = torch.tensor([e for e in range(experts) if e != 1], device=DEV)
    ids = choice[torch.randint(0, len(choice), (1500, 2), device=DEV, generator=gen)]
    sched = build_row_schedule(ids, experts, 128)
    used = int(sched.num_blocks.item()) * 128
    row_expert = sched.block_expert[: used // 128].long().repeat_interleave(128)
    return sched, used, row_expert, gen


def _rows(sched, width: int, gen) -> torch.Tensor:
    """bf16 rows of the schedule's layout, zeros in its padding rows (as the layer's)."""
    real = (sched.row_src >= 0).to(torch.bfloat16)[:, None]
    return torch.randn(sched.rows, width, device=DEV, generator=gen).to(torch.bfloat16) * real


def _weights64(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 of 128x128-quantized weights [E, N, K]."""
    s = scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return q.double() * s[:, : q.shape[1], : q.shape[2]]


def _gate_up_operands(h: int, i: int, experts: int, seed: int):
    """``_routed_rows``' schedule, used rows and row experts, and gate/up's operands on it:
    the rows 1x128-quantized (x, its scales) and two random [E, I, H] weights 128x128-quantized
    (gate, up)."""
    from megamoe.kernels import fp8

    sched, used, row_expert, gen = _routed_rows(experts, seed=h + i + experts + seed)
    x, x_scale = fp8.quantize_rows(_rows(sched, h, gen))
    w = [torch.randn(experts, i, h, device=DEV, generator=gen) / h**0.5 for _ in range(2)]
    w_gate, w_up = (fp8.quantize_weight(t.to(torch.bfloat16)) for t in w)
    return sched, used, row_expert, (x, x_scale, w_gate, w_up)


def _warp_specialized_and_triton(
    monkeypatch, kind: str, run, group_m: int = 1, bn: int | None = None, bm: int = 128
):
    """``run()`` with tiles[kind] warp-specialized (``bn`` columns wide, or its width kept;
    wide tiles, 256 columns or gate/up's 128 of each weight, with 3 stages; the row tiles in
    groups of ``group_m``; the weight gradient's ``bm`` rows: 192, three consumers) and then
    on the Triton kernel (``fp8_gemm.triton_tiles``), on poisoned buffers: (ws, triton)."""
    import dataclasses

    from megamoe.kernels import fp8_gemm

    bn = bn or fp8_gemm.GPU_TILES[kind].bn
    wide = bn > (64 if kind == "gate_up" else 128)
    ws_tiles = dataclasses.replace(
        fp8_gemm.WARP_SPECIALIZED, bn=bn, bm=bm, group_m=group_m, stages=3 if wide else 4
    )
    triton_tiles = dataclasses.replace(
        fp8_gemm.triton_tiles(kind, ws_tiles), warp_specialized=False
    )
    with poisoned_buffers():
        monkeypatch.setitem(fp8_gemm.GPU_TILES, kind, ws_tiles)
        ws = run()
        monkeypatch.setitem(fp8_gemm.GPU_TILES, kind, triton_tiles)
        return ws, run()


def _check_ws(ws, triton_out, used, row_expert, experts, reference) -> None:
    """Every written row bitwise the Triton kernel's, none left unwritten, and the first and
    last experts within bf16 rounding of the float64 product (``reference(rows, e)``)."""
    assert not ws[:used].isnan().any(), "rows the kernel did not write"
    assert torch.equal(ws[:used], triton_out[:used]), "not the Triton kernel's bits"
    for e in (0, experts - 1):
        rows = (row_expert == e).nonzero().squeeze(1)
        ref = reference(rows, e)
        err = (ws[rows].double() - ref).norm() / ref.norm()
        assert err <= 3e-3, f"expert {e}: relative error {err:.3g} from float64"


SHAPES_WS = [(7168, 2048, 8), (2880, 2880, 5), (2048, 768, 6)]


# (CTAs, row tiles walked together): the whole grid, 7 CTAs of several tiles each, groups of 8
# row tiles (the last one partial) and of 3 on 7 CTAs
WALKS = [(None, 1), (7, 1), (None, 8), (7, 3)]


@pytest.mark.parametrize("h, i, experts", SHAPES_WS)
@pytest.mark.parametrize("programs, group_m", WALKS)
@pytest.mark.parametrize("bn", [128, 256])
def test_warp_specialized_forward_down_gives_the_triton_kernels_bits(
    monkeypatch, h: int, i: int, experts: int, programs: int | None, group_m: int, bn: int
) -> None:
    """``fp8_ws``'s Gluon kernel (tiles ``warp_specialized``, 128 or 256 columns) against the
    Triton kernel on the forward down: an expert of no rows, K steps odd (2880) and even, a
    partial last column tile (N 2880: of a wide tile, half a 128-column block and a block past
    N), each of ``WALKS``."""
    from megamoe.kernels import fp8, fp8_gemm

    sched, used, row_expert, gen = _routed_rows(experts, seed=h + i + experts)
    a, a_scale = fp8.quantize_rows(_rows(sched, i, gen))
    wd = torch.randn(experts, h, i, device=DEV, generator=gen) / i**0.5
    w_down = fp8.quantize_weight(wd.to(torch.bfloat16))
    ws, triton_z = _warp_specialized_and_triton(
        monkeypatch,
        "mm",
        lambda: fp8_gemm.grouped_mm(a, a_scale, w_down, sched, programs),
        group_m,
        bn,
    )
    a64, w64 = fp8.dequantize_rows(a, a_scale).double(), _weights64(w_down.q, w_down.scale)
    _check_ws(ws, triton_z, used, row_expert, experts, lambda rows, e: a64[rows] @ w64[e].T)


@pytest.mark.parametrize("h, i, experts", [*SHAPES_WS, (2048, 1000, 4)])
@pytest.mark.parametrize("programs, group_m", WALKS)
@pytest.mark.parametrize("bn", [64, 128])
def test_warp_specialized_gate_up_gives_the_triton_kernels_bits(
    monkeypatch, h: int, i: int, experts: int, programs: int | None, group_m: int, bn: int
) -> None:
    """The same for gate/up: g, u and h = silu(g) * u (64 or 128 columns of each weight a
    tile; I 2880 ends in half a 128-column scale block, 1000 in a partial tile), each against
    the Triton kernel's bits (64-column tiles) and the float64 product (h: SwiGLU of the
    float64 g and u)."""
    from megamoe.kernels import fp8, fp8_gemm

    sched, used, row_expert, (x, x_scale, w_gate, w_up) = _gate_up_operands(h, i, experts, 3)
    ws, triton_guh = _warp_specialized_and_triton(
        monkeypatch,
        "gate_up",
        lambda: fp8_gemm.gate_up(x, x_scale, w_gate, w_up, sched, programs),
        group_m,
        bn,
    )
    x64 = fp8.dequantize_rows(x, x_scale).double()
    wg64, wu64 = (_weights64(t.q, t.scale) for t in (w_gate, w_up))
    g64 = lambda rows, e: x64[rows] @ wg64[e].T  # noqa: E731
    u64 = lambda rows, e: x64[rows] @ wu64[e].T  # noqa: E731
    h64 = lambda rows, e: torch.nn.functional.silu(g64(rows, e)) * u64(rows, e)  # noqa: E731
    for out, theirs, ref in zip(ws, triton_guh, (g64, u64, h64)):
        _check_ws(out, theirs, used, row_expert, experts, ref)


def _assert_quantized_equal(name: str, got, want, used: int) -> None:
    """One output's 1x128 (q, scales) and 128x1 (x^T, its scales; ``fp8.rows_cols_buffers``'
    layouts) quantizations bitwise equal on the ``used`` rows, the scales finite and > 0."""
    (q, s), (q_t, s_t) = got
    (wq, ws), (wq_t, ws_t) = want
    blocks = -(-used // 128)
    assert torch.equal(q[:used].view(torch.uint8), wq[:used].view(torch.uint8)), f"{name} 1x128"
    assert torch.equal(s[:used], ws[:used]), f"{name}'s 1x128 scales"
    assert torch.equal(q_t[:, :used].view(torch.uint8), wq_t[:, :used].view(torch.uint8)), name
    assert torch.equal(s_t[:, :blocks], ws_t[:, :blocks]), f"{name}'s 128x1 scales"
    assert s[:used].isfinite().all() and (s[:used] > 0).all(), f"{name}'s 1x128 scales"
    assert s_t[:, :blocks].isfinite().all() and (s_t[:, :blocks] > 0).all(), name


@pytest.mark.parametrize("h, i, experts", [*SHAPES_WS, (2048, 1008, 4), (2048, 1000, 4)])
@pytest.mark.parametrize("programs, group_m", WALKS)
def test_gate_up_epilogue_quantizes_h_with_the_passes_bits(
    monkeypatch, h: int, i: int, experts: int, programs: int | None, group_m: int
) -> None:
    """``fp8_gemm.gate_up_quantized`` on the warp-specialized wide tiles, whose epilogue
    quantizes h (the two consumers' column maxima exchanged), against the Triton kernel and
    ``quantize_rows_cols``' pass over its bf16 h: g, u, h's 1x128 quantization and the packed
    rows of h^T (bytes and scales), bitwise on the used rows (I 2880 ends in half a scale
    block, 1008 in a partial tile; several tiles a CTA, so both tile parities of the exchange;
    I 1000, whose fp8 rows TMA cannot store, takes the pass)."""
    from megamoe.kernels import fp8, fp8_gemm

    sched, used, _, (x, x_scale, w_gate, w_up) = _gate_up_operands(h, i, experts, 5)
    ws, ref = _warp_specialized_and_triton(
        monkeypatch,
        "gate_up",
        lambda: fp8_gemm.gate_up_quantized(x, x_scale, w_gate, w_up, sched, programs),
        group_m,
        128,
    )
    for name, a, b in zip(("g", "u"), ws[:2], ref[:2]):
        assert not a[:used].isnan().any(), f"{name}: rows the kernel did not write"
        assert torch.equal(a[:used], b[:used]), f"{name}: not the Triton kernel's bits"
    got, want = ((out[2], fp8.unpack_rows(out[3], sched.rows + -sched.rows % 16))
                 for out in (ws, ref))  # fmt: skip
    _assert_quantized_equal("h", got, want, used)


def test_gate_up_waits_for_arriving_rows_and_names_a_stall() -> None:
    """``arrivals`` (the pipelined fp8 forward's): the warp-specialized gate/up kernel loads a
    row block only once its minibatch's counter is complete. Every counter complete: the plain
    launch's bits (on fewer SMs). One counter never complete: that wait gives up after its
    budget, the stall record names the rows and the minibatch, and the kernel ends."""
    from megamoe.ep.workspace import check_errors, local_workspace
    from megamoe.errors import StallError
    from megamoe.kernels import fp8, fp8_gemm, fp8_ws

    sched, used, _, ops = _gate_up_operands(2048, 1024, 8, 7)
    mb, wanted = 256, 3
    errors = local_workspace(16, 64, 1, torch.bfloat16, DEV)  # (its stall record)
    counters = torch.full((-(-sched.rows // mb),), wanted, dtype=torch.int32, device=DEV)
    arrivals = fp8_ws.RowArrivals(counters, mb, wanted, errors.errors, 0, 1 << 12)
    with poisoned_buffers():
        plain = fp8_gemm.gate_up_quantized(*ops, sched)
        waited = fp8_gemm.gate_up_quantized(*ops, sched, 100, arrivals)
    check_errors(errors)
    got, want = ((g, u, hq, fp8.unpack_rows(h_t, sched.rows + -sched.rows % 16))
                 for g, u, (hq, _), h_t in (waited, plain))  # fmt: skip
    for name, a, b in zip(("g", "u"), got[:2], want[:2]):
        assert not a[:used].isnan().any(), f"{name}: rows the kernel did not write"
        assert torch.equal(a[:used], b[:used]), f"{name}: not the plain launch's bits"
    _assert_quantized_equal("h", (waited[2], got[3]), (plain[2], want[3]), used)
    counters[1] = wanted - 1  # minibatch 1's rows never arrive
    fp8_gemm.gate_up_quantized(*ops, sched, 100, arrivals)
    torch.cuda.synchronize()
    with pytest.raises(StallError, match="pulled rows of a minibatch") as stall:
        check_errors(errors)
    message = str(stall.value)
    assert "(index 1)" in message and f"flag was {wanted - 1}, wanted >= {wanted}" in message


@pytest.mark.parametrize("h, i, experts", SHAPES_WS)
@pytest.mark.parametrize("programs, group_m", [(None, 0), (7, 3)])
def test_warp_specialized_swiglu_backward_gives_the_triton_kernels_bits(
    monkeypatch, h: int, i: int, experts: int, programs: int | None, group_m: int
) -> None:
    """The same for the dgrad of down with the SwiGLU backward epilogue: d_h = d_z W_down
    (the weight's transposed copy), then (d_g, d_u) from the saved g and u, each against the
    Triton kernel's bits and the float64 SwiGLU backward of the float64 d_h."""
    from megamoe.kernels import fp8, fp8_gemm

    sched, used, row_expert, gen = _routed_rows(experts, seed=h + i + experts + 4)
    dz, dz_scale = fp8.quantize_rows(_rows(sched, h, gen))
    g, u = (_rows(sched, i, gen) for _ in range(2))
    wd = torch.randn(experts, h, i, device=DEV, generator=gen) / i**0.5
    w_down = fp8.quantize_weight(wd.to(torch.bfloat16), transposed=True)
    ws, triton_gu = _warp_specialized_and_triton(
        monkeypatch,
        "swiglu_bwd",
        lambda: fp8_gemm.dgrad_swiglu(dz, dz_scale, w_down, g, u, sched, programs),
        group_m,
    )
    dz64, wt64 = fp8.dequantize_rows(dz, dz_scale).double(), _weights64(w_down.q_t, w_down.scale_t)
    g64, u64 = g.double(), u.double()

    def reference(rows, e, which):
        dh = dz64[rows] @ wt64[e].T
        sig = torch.sigmoid(g64[rows])
        silu = g64[rows] * sig
        return dh * u64[rows] * sig * (1 + g64[rows] * (1 - sig)) if which == 0 else dh * silu

    for which, (out, theirs) in enumerate(zip(ws, triton_gu)):
        _check_ws(out, theirs, used, row_expert, experts, lambda r, e: reference(r, e, which))


@pytest.mark.parametrize(
    "h, i, experts", [*SHAPES_WS, (2048, 1008, 4), (2048, 1000, 4), (2048, 768, 0)]
)
@pytest.mark.parametrize("programs, group_m", [(None, 0), (7, 3)])
def test_swiglu_backward_epilogue_quantizes_dg_du_with_the_passes_bits(
    monkeypatch, h: int, i: int, experts: int, programs: int | None, group_m: int
) -> None:
    """``fp8_gemm.dgrad_swiglu_quantized`` on the warp-specialized kernel, whose epilogue
    quantizes d_g and d_u (the two consumers' column maxima exchanged, each output its own
    slots), against the Triton kernel and ``quantize_rows_cols``' pass over its bf16 d_g and
    d_u: both quantizations of both, bitwise on the used rows (I 2880 ends in half a scale
    block, 1008 in a partial tile; 7 CTAs of several tiles each, so both tile parities of the
    exchange; I 1000, whose fp8 rows TMA cannot store, takes the pass on both sides: it checks
    only that the fallback runs). Experts 0: the shared expert's layout, one expert of 1000
    rows (a partial row tile; the 128x1 operands' rows padded to 1008 with zeros)."""
    from megamoe.kernels import fp8, fp8_gemm
    from megamoe.kernels.schedule import uniform_schedule

    if experts:
        sched, used, _, gen = _routed_rows(experts, seed=h + i + experts + 6)
        rows = sched.rows
    else:
        gen, rows = torch.Generator(device=DEV).manual_seed(6), 1000
        sched, used, experts = uniform_schedule(rows, 128, DEV), rows, 1
    dz_rows = (_rows(sched, h, gen) if rows == sched.rows
               else torch.randn(rows, h, device=DEV, generator=gen).to(torch.bfloat16))  # fmt: skip
    dz, dz_scale = fp8.quantize_rows(dz_rows)
    monkeypatch.setitem(fp8_gemm.EPILOGUE_QUANTIZES, "dgdu", True)  # (not the default: slower)
    g, u = (torch.randn(rows, i, device=DEV, generator=gen).to(torch.bfloat16) for _ in range(2))
    wd = torch.randn(experts, h, i, device=DEV, generator=gen) / i**0.5
    w_down = fp8.quantize_weight(wd.to(torch.bfloat16), transposed=True)
    ws, ref = _warp_specialized_and_triton(
        monkeypatch,
        "swiglu_bwd",
        lambda: fp8_gemm.dgrad_swiglu_quantized(dz, dz_scale, w_down, g, u, sched, programs),
        group_m,
    )
    for name, got, want in zip(("d_g", "d_u"), ws, ref):
        _assert_quantized_equal(name, got, want, used)
        pad = got[1][0][:, rows:].view(torch.uint8)  # (rows up to a multiple of 16)
        assert not pad.any(), f"{name}: x^T's padding rows are not zero"


@pytest.mark.parametrize("h, i, experts", SHAPES_WS)
@pytest.mark.parametrize("bn", [128, 256])
def test_warp_specialized_dgrad_of_gate_up_gives_the_triton_kernels_bits(
    monkeypatch, h: int, i: int, experts: int, bn: int
) -> None:
    """The same for the two-pair product d_x = d_g W_gate + d_u W_up (one accumulator, the
    first pair's K steps first), on 7 CTAs, 128 or 256 columns a tile."""
    from megamoe.kernels import fp8, fp8_gemm

    sched, used, row_expert, gen = _routed_rows(experts, seed=h + i + experts + 1)
    dg, du = (fp8.quantize_rows(_rows(sched, i, gen)) for _ in range(2))
    w = [torch.randn(experts, i, h, device=DEV, generator=gen) / h**0.5 for _ in range(2)]
    w_gate, w_up = (fp8.quantize_weight(x.to(torch.bfloat16), transposed=True) for x in w)
    ws, triton_dx = _warp_specialized_and_triton(
        monkeypatch, "pair", lambda: fp8_gemm.dgrad_pair(*dg, w_gate, *du, w_up, sched, 7), bn=bn
    )
    dg64, du64 = (fp8.dequantize_rows(*x).double() for x in (dg, du))
    wg64, wu64 = (_weights64(x.q_t, x.scale_t) for x in (w_gate, w_up))
    _check_ws(
        ws,
        triton_dx,
        used,
        row_expert,
        experts,
        lambda rows, e: dg64[rows] @ wg64[e].T + du64[rows] @ wu64[e].T,
    )


@pytest.mark.parametrize("h, i, experts", SHAPES_WS)
@pytest.mark.parametrize(
    "out_dtype, programs, bn, bm",
    [(torch.bfloat16, None, 256, 128), (torch.bfloat16, 7, 256, 128),
     (torch.bfloat16, None, 128, 128), (torch.float32, 7, 128, 128),
     (torch.bfloat16, None, 128, 192), (torch.bfloat16, 7, 128, 192)],
)  # fmt: skip
def test_warp_specialized_weight_gradient_gives_the_triton_kernels_bits(
    monkeypatch,
    h: int,
    i: int,
    experts: int,
    out_dtype: torch.dtype,
    programs: int | None,
    bn: int,
    bm: int,
) -> None:
    """The same for the weight gradient d_W[e] = A_e^T B_e over each expert's rows (the K
    loop's length per expert; expert 1 has none and gets zeros), in bf16 and in fp32
    (``wgrad_fp32``), as the down's [E, H, I] from d_z [rows, H] and h [rows, I], in wide
    tiles (256 columns: four 64-column partial accumulators a consumer; I = 2880 ends in a
    partial one), 128-column ones, and 192 x 128 ones of three consumers (H = 7168 and 2048
    end in a partial row tile)."""
    from megamoe.kernels import fp8, fp8_gemm

    sched, used, row_expert, gen = _routed_rows(experts, seed=h + i + experts + 2)
    a_t, b_t = (fp8.quantize_cols(_rows(sched, width, gen)) for width in (h, i))
    kind = "wgrad_fp32" if out_dtype == torch.float32 else "wgrad"
    ws, triton_dw = _warp_specialized_and_triton(
        monkeypatch,
        kind,
        lambda: fp8_gemm.wgrad(*a_t, *b_t, sched, programs, out_dtype=out_dtype),
        bn=bn,
        bm=bm,
    )
    assert not ws.isnan().any(), "elements the kernel did not write"
    assert torch.equal(ws, triton_dw), "not the Triton kernel's bits"
    assert not ws[1].any(), "the expert without rows has a nonzero gradient"
    a64, b64 = (fp8.dequantize_rows(*x).double() for x in (a_t, b_t))
    starts = sched.row_start.tolist()
    for e in (0, experts - 1):
        rows = slice(starts[e], starts[e + 1])
        ref = a64[:, rows] @ b64[:, rows].T
        err = (ws[e].double() - ref).norm() / ref.norm()
        assert err <= 3e-3, f"expert {e}: relative error {err:.3g} from float64"


@pytest.mark.parametrize("h", [7168, 2880])
def test_route_grad_writes_dz_quantized_with_the_passes_bits(h: int) -> None:
    """The fp8 backward's route grad (``quantize=True``) on the GPU: d_z's 1x128 and 128x1
    quantizations bitwise ``fp8.quantize_rows_cols`` of the bf16 d_z of the plain route grad,
    by token and (pulled) by row, on poisoned buffers; dw the same by token and by row and
    within fp32 summation of float64."""
    from megamoe.kernels import fp8, rows
    from megamoe.kernels.schedule import build_row_schedule

    t, k, e = 4000, 8, 32
    gen = torch.Generator(device=DEV).manual_seed(h)
    ids = torch.rand(t, e, device=DEV, generator=gen).topk(k, dim=1).indices
    sched = build_row_schedule(ids, e, 128)
    scale = torch.rand(t, 1, device=DEV, generator=gen) * 8
    dy = (torch.randn(t, h, device=DEV, generator=gen) * scale).bfloat16()
    w = torch.rand(t, k, device=DEV, generator=gen)
    z = torch.randn(sched.rows, h, device=DEV, generator=gen).bfloat16()
    packed = fp8.quantize_packed(dy)
    dz, _ = rows.route_grad(packed, z, w, sched)
    with poisoned_buffers():
        want = fp8.quantize_rows_cols(dz)
        got = rows.route_grad(packed, z, w, sched, quantize=True)
        got_rows = rows.route_grad_rows(rows.gather(packed, sched), z, w, sched, quantize=True)
    used = int(sched.num_blocks) * 128
    slots = sched.row_src[:used].long()
    real = slots >= 0
    for q, dw in (got, got_rows):
        (qr, sr), (qc, sc) = q
        (wr, wsr), (wc, wsc) = want
        assert torch.equal(qr[:used].view(torch.uint8), wr[:used].view(torch.uint8))
        assert torch.equal(sr[:used], wsr[:used])
        assert torch.equal(qc[:, :used].view(torch.uint8), wc[:, :used].view(torch.uint8))
        assert torch.equal(sc[:, : used // 128], wsc[:, : used // 128])
    dw = got[1].view(-1)[slots[real]]
    assert torch.equal(got_rows[1][:used][real], dw)
    dq = fp8.dequantize_rows(*fp8.unpack_rows(packed, h))
    prods = dq[slots[real] // k].double() * z[:used][real].double()
    assert ((dw.double() - prods.sum(1)).abs() <= 1e-5 * prods.abs().sum(1)).all()


def _same_quantized(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp8 tensors with NaN where the other has NaN and the same bytes elsewhere (the sign of
    a NaN's byte is the conversion's)."""
    nan = want.float().isnan()
    return torch.equal(got.float().isnan(), nan) and torch.equal(
        got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]
    )


@pytest.mark.parametrize("m, k", [(300, 7168), (1000, 2880)])
def test_quantizers_match_torch_with_nan_and_inf(m: int, k: int) -> None:
    """The compiled quantizers against the torch reference (tests/support/fp8_reference.py):
    ``quantize_rows``, ``quantize_cols``, ``quantize_rows_cols``, ``quantize_packed``,
    ``requantize_cols`` and ``quantize_weight`` (of bf16 and fp32 weights), on poisoned buffers,
    with magnitudes over 2^±40, NaNs (ignored by their blocks' scales), an inf (its block NaN
    when dequantized), an all-NaN block (scale 1) and a zero block."""
    from megamoe.kernels import fp8
    from support.fp8_reference import ref_quantize_rows, ref_quantize_weight

    gen = torch.Generator(device=DEV).manual_seed(m)
    mag = torch.exp2(torch.randint(-40, 40, (m, 1), device=DEV, generator=gen).float())
    x = (torch.randn(m, k, device=DEV, generator=gen) * mag).bfloat16()
    x[3, 5] = x[130, 200] = x[7, 1000] = float("nan")  # one NaN in a row and in a column block
    x[9, 17] = float("inf")
    x[256:300, 128:256] = float("nan")  # (at M = 300: all of the last row block's 128x1 blocks)
    x[:128, 256:384] = float("nan")  # 1x128 blocks and 128x1 blocks all NaN
    x[128:256, 384:512] = 0.0
    want_q, want_s = ref_quantize_rows(x.cpu())
    want_qt, want_st = ref_quantize_rows(x.t().cpu())
    with poisoned_buffers():
        q, s = fp8.quantize_rows(x)
        qt, st = fp8.quantize_cols(x)
        (q2, s2), (qt2, st2) = fp8.quantize_rows_cols(x, pad_to=16)
        pq, ps = fp8.unpack_rows(fp8.quantize_packed(x), k)
        rq, rs = fp8.requantize_cols(q, s)
    for got_q, got_s in ((q, s), (q2, s2), (pq, ps)):
        assert _same_quantized(got_q.cpu(), want_q) and torch.equal(got_s.cpu(), want_s)
    for got_q, got_s in ((qt, st), (qt2[:, :m], st2)):
        assert _same_quantized(got_q.cpu(), want_qt) and torch.equal(got_s.cpu(), want_st)
    assert not qt2[:, m:].view(torch.uint8).any(), "the zero padding rows of x'^T"
    want_rq, want_rs = ref_quantize_rows(fp8.dequantize_rows(q, s).t().cpu())
    assert _same_quantized(rq.cpu(), want_rq) and torch.equal(rs.cpu(), want_rs)

    bf16_w = x[: m - m % 100].view(-1, 100, k)[:, :, :1000]  # [E, 100, 1000], strided
    for w in (bf16_w, bf16_w.float()):  # (an fp32 tile's transposed copy is stored by address)
        with poisoned_buffers():
            qw = fp8.quantize_weight(w, transposed=True)
            only_t = fp8.quantize_weight(w, transposed=True, plain=False)  # (a backward's)
        want_w, want_ws = ref_quantize_weight(w.cpu())
        assert _same_quantized(qw.q.cpu(), want_w) and torch.equal(qw.scale.cpu(), want_ws)
        for t in (qw, only_t):
            assert _same_quantized(t.q_t.cpu(), want_w.transpose(1, 2).contiguous()), w.dtype
            assert torch.equal(t.scale_t.cpu(), want_ws.transpose(1, 2))
