"""``megamoe.optim.AdamW`` on one Hopper GPU: the update at dsv3's weight shapes against float64
AdamW and torch's fused AdamW, the fp8 copies it writes against ``fp8.quantize_weight``, and a
fp8 layer reading those copies (nothing quantized in its forward, the bits of a layer that
quantizes the same weights itself).

Run on the device: ``python -m pytest tests/gpu/test_optim.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import megamoe  # noqa: E402
from megamoe import optim  # noqa: E402
from megamoe.backends import fp8_weights  # noqa: E402
from megamoe.kernels import adamw, fp8  # noqa: E402
from megamoe.kernels.runtime import poisoned_buffers  # noqa: E402
from support.adamw import BETAS, EPS, LR, WD, adamw64, within_one_rounding  # noqa: E402
from support.bits import same_fp8_weight  # noqa: E402
from support.problems import Case, make_problem  # noqa: E402

DEV = torch.device("cuda")


@pytest.mark.parametrize("reread", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_update_and_copies_at_dsv3_shapes(
    dtype: torch.dtype, reread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four of dsv3's experts (stacked gate/up [4, 4096, 7168], down [4, 7168, 2048]) and a
    shared expert's [2048, 7168], three steps: each within one rounding of float64 AdamW from
    the same state, within two roundings (and torch's fp32 error) of torch's fused AdamW, and
    the copies ``quantize_weight``'s bits of the new weights (poisoned buffers); the new
    blocks kept in registers or read back."""
    monkeypatch.setattr(adamw, "_BLOCK_REREAD", reread)
    gen = torch.Generator(device=DEV).manual_seed(0)
    shapes = [(4, 4096, 7168), (4, 7168, 2048), (2048, 7168)]
    ours = [torch.nn.Parameter(torch.randn(s, device=DEV, generator=gen).to(dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    views = [ours[0][:, :2048], ours[0][:, 2048:], ours[1], ours[2][None]]
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt = optim.AdamW(ours, **kw, fp8_views=views)
    ref = torch.optim.AdamW(theirs, fused=True, **kw)
    for step in range(1, 4):
        want = {}
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, device=DEV, generator=gen).to(dtype)
            q.grad = p.grad.clone()
            st = opt.state[p]
            m, v = (st[k] if st else torch.zeros_like(p) for k in ("exp_avg", "exp_avg_sq"))
            want[p] = adamw64(p.detach(), p.grad, m, v, step)
        with poisoned_buffers():
            opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            st = opt.state[p]
            for got, (w64, size) in zip((p.detach(), st["exp_avg"], st["exp_avg_sq"]), want[p]):
                assert within_one_rounding(got, w64, size), f"step {step} {list(p.shape)}"
            # torch's roundings, of its moments from its own steps too: within two of the
            # stored dtype's at the terms' size, plus its fp32 arithmetic's (fast-math square
            # root and division: up to a few fp32 roundings, what an fp32 parameter shows)
            p64, size = want[p][0]
            eps = 2 * torch.finfo(dtype).eps + 8 * torch.finfo(torch.float32).eps
            bound = eps * (p64.abs() + size)
            worst = ((q.detach().double() - p.detach().double()).abs() / bound).max().item()
            assert worst <= 1.0, f"step {step} {list(p.shape)}: {worst:.2f} of the bound"
        count = fp8_weights.CACHE.quantizations
        for view in views:
            fresh = fp8.quantize_weight(view, transposed=True)
            assert same_fp8_weight(fp8_weights.get(view), fresh)
        assert fp8_weights.CACHE.quantizations == count  # (every view a hit)


def test_the_layer_reads_the_updates_copies() -> None:
    """A dsv3-like fp8 layer (8 experts, a shared expert) trained two steps with the copies:
    its forward after a step quantizes nothing, and gives the bits of the layer quantizing the
    same weights itself."""
    case = Case(512, 7168, 2048, 8, 4, shared=2048, block_rows=128)
    p = make_problem(case, seed=2, device=DEV, precision="fp8", minibatch_rows=1024, ring_rows=None)
    x, ids, tw, dy = p.single
    moe = megamoe.MoE(p.config, backend="triton", device=DEV, seed=5)
    opt = optim.AdamW(moe.parameters(), fp8_views=optim.fp8_weight_views(moe), lr=1e-3)
    cache = fp8_weights.CACHE

    def step() -> list[torch.Tensor]:
        moe.zero_grad(set_to_none=True)
        with poisoned_buffers():
            y = moe(x, ids, tw)
            y.backward(dy)
        return [y.detach()] + [w.grad.clone() for w in moe.parameters()]

    fp8_weights.clear()
    for _ in range(2):
        step()
        opt.step()
        count = cache.quantizations
        got = step()
        assert cache.quantizations == count
        cache.clear()
        want = step()
        assert cache.quantizations == count + 6
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
