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
            bm=(t.bm if row_bm == 0 else row_bm) if kind.startswith("wgrad") else row_bm,
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


@pytest.mark.parametrize("h, i, experts", [(7168, 2048, 8), (2880, 2880, 5), (2048, 768, 6)])
@pytest.mark.parametrize("programs", [None, 7])
def test_warp_specialized_forward_down_gives_the_triton_kernels_bits(
    monkeypatch, h: int, i: int, experts: int, programs: int | None
) -> None:
    """``fp8_ws``'s Gluon kernel (tiles ``warp_specialized``) against the Triton kernel on
    the forward down: every written row bitwise, on a poisoned output, with an expert of no
    rows, K steps odd (2880) and even, a partial last column tile (N 2880), the whole grid and
    7 CTAs of several tiles each; and both within bf16 rounding of the float64 product of the
    quantized operands."""
    import dataclasses

    from megamoe.kernels import fp8, fp8_gemm
    from megamoe.kernels.schedule import build_row_schedule

    gen = torch.Generator(device=DEV).manual_seed(h + i + experts)
    tokens, top_k = 1500, 2
    # expert 1 gets no rows; the others uneven loads
    choice = torch.tensor([e for e in range(experts) if e != 1], device=DEV)
    ids = choice[torch.randint(0, len(choice), (tokens, top_k), device=DEV, generator=gen)]
    sched = build_row_schedule(ids, experts, 128)
    used = int(sched.num_blocks.item()) * 128
    real = (sched.row_src >= 0).to(torch.bfloat16)[:, None]
    hh = torch.randn(sched.rows, i, device=DEV, generator=gen).to(torch.bfloat16) * real
    wd = torch.randn(experts, h, i, device=DEV, generator=gen) / i**0.5
    w_down = fp8.quantize_weight(wd.to(torch.bfloat16))
    a, a_scale = fp8.quantize_rows(hh)
    triton_tiles = dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, warp_specialized=False)
    with poisoned_buffers():
        monkeypatch.setitem(fp8_gemm.GPU_TILES, "mm", fp8_gemm.WARP_SPECIALIZED)
        ws_z = fp8_gemm.grouped_mm(a, a_scale, w_down, sched, programs)
        monkeypatch.setitem(fp8_gemm.GPU_TILES, "mm", triton_tiles)
        triton_z = fp8_gemm.grouped_mm(a, a_scale, w_down, sched, programs)
    assert not ws_z[:used].isnan().any(), "rows the kernel did not write"
    assert torch.equal(ws_z[:used], triton_z[:used]), "not the Triton kernel's bits"
    # float64 of the quantized operands for the first and last expert with rows
    a64 = fp8.dequantize_rows(a, a_scale).double()
    s = w_down.scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    w64 = w_down.q.double() * s[:, :h, :i]
    row_expert = sched.block_expert[: used // 128].long().repeat_interleave(128)
    for e in (0, experts - 1):
        rows = (row_expert == e).nonzero().squeeze(1)
        ref = a64[rows] @ w64[e].T
        err = (ws_z[rows].double() - ref).norm() / ref.norm()
        assert err <= 3e-3, f"expert {e}: relative error {err:.3g} from float64"
