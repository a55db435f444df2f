"""``megamoe.optim.AdamW`` under the interpreter: the update against a float64 AdamW and
torch's, the fp8 copies it writes (``fp8.quantize_weight``'s bits of the new weights) and the
layer reading them without quantizing, the state's compatibility with ``torch.optim.AdamW``,
every output written, and the errors."""

from __future__ import annotations

import copy

import pytest
import torch

import megamoe
from megamoe import optim
from megamoe.backends import fp8_weights
from megamoe.kernels import adamw, fp8
from megamoe.kernels.runtime import poisoned_buffers
from support.adamw import BETAS, EPS, LR, WD, adamw64, within_one_rounding
from support.bits import same_fp8_weight
from support.problems import Case, make_problem

# H 144 / I 112: partial 128 blocks along both dims of every weight; a shared expert of 48.
CASE = Case(24, 144, 112, 2, 1, shared=48, block_rows=128)


@pytest.mark.parametrize("reread", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_against_float64_adamw_and_the_copies(
    dtype: torch.dtype, reread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three steps of a stacked [E, 2I, H] weight (its halves quantized), a 2-D weight
    (quantized as p[None]) and a vector (no copies): each step within one rounding (and the
    fp32 arithmetic's) of float64 AdamW from the same state, the copies ``quantize_weight``'s
    bits of the new weights, every copy and update written (poisoned buffers); the new
    blocks kept in registers or read back."""
    monkeypatch.setattr(adamw, "_BLOCK_REREAD", reread)
    gen = torch.Generator().manual_seed(0)
    stacked = torch.nn.Parameter(torch.randn(2, 2 * 112, 144, generator=gen).to(dtype))
    flat = torch.nn.Parameter(torch.randn(48, 144, generator=gen).to(dtype))
    bias = torch.nn.Parameter(torch.randn(300, generator=gen).to(dtype))
    views = [stacked[:, :112], stacked[:, 112:], flat[None]]
    opt = optim.AdamW([stacked, flat, bias], LR, BETAS, EPS, WD, fp8_views=views)
    fp8_weights.clear()
    for step in range(1, 4):
        before = {}
        for p in (stacked, flat, bias):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            state = opt.state[p]
            zeros = torch.zeros_like(p)
            m, v = (state[k].clone() if state else zeros for k in ("exp_avg", "exp_avg_sq"))
            before[p] = adamw64(p.detach(), p.grad, m, v, step)
        with poisoned_buffers():
            opt.step()
        for p, want in before.items():
            state = opt.state[p]
            assert state["step"].item() == step
            for got, (ref, size) in zip((p.detach(), state["exp_avg"], state["exp_avg_sq"]), want):
                assert within_one_rounding(got, ref, size)
        count = fp8_weights.CACHE.quantizations
        for view in views:
            cached = fp8_weights.get(view)
            assert same_fp8_weight(cached, fp8.quantize_weight(view.detach(), transposed=True))
        assert fp8_weights.CACHE.quantizations == count  # (hits: the update's copies)


@pytest.mark.parametrize("reread", [False, True])
def test_the_copies_and_the_plain_update_have_the_same_bits(
    reread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight's update does not depend on whether its copies are written."""
    monkeypatch.setattr(adamw, "_BLOCK_REREAD", reread)
    gen = torch.Generator().manual_seed(1)
    p, g, m = (torch.randn(3, 130, 260, generator=gen).bfloat16() for _ in range(3))
    v = torch.rand(3, 130, 260, generator=gen).bfloat16()
    hyper = adamw.AdamWStep(LR, *BETAS, EPS, WD, step=5)
    a = [t.clone() for t in (p, m, v)]
    b = [t.clone() for t in (p, m, v)]
    adamw.adamw_(a[0], g, a[1], a[2], hyper)
    adamw.adamw_quantize_(b[0], g, b[1], b[2], hyper)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_against_torch_adamw_and_its_state_dict() -> None:
    """fp32 parameters: three steps within 1e-6 of ``torch.optim.AdamW`` (its per-op
    roundings and m's lerp against one rounding; 1e-7 absolute where m cancels), then
    torch's state dict loaded and two more steps alike."""
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(2, 64, 48, generator=gen), torch.randn(17, generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    a = optim.AdamW(ours, **kw)
    b = torch.optim.AdamW(theirs, foreach=False, **kw)
    for step in range(5):
        if step == 3:
            a.load_state_dict(copy.deepcopy(b.state_dict()))  # (its tensors, else shared)
        for x, y in zip(ours, theirs):
            x.grad = torch.randn(x.shape, generator=gen)
            y.grad = x.grad.clone()
        a.step()
        b.step()
        for x, y in zip(ours, theirs):
            torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(a.state[x][key], b.state[y][key], rtol=1e-6, atol=1e-7)
            assert a.state[x]["step"].item() == b.state[y]["step"].item() == step + 1


def test_the_layer_reads_the_updates_copies() -> None:
    """A fp8 ``MoE`` trained with the optimizer's copies: the forward after a step quantizes
    nothing, and its output and gradients are those of a layer quantizing the same weights
    itself; a step of another optimizer keeps the copies, a write to a weight drops its own."""
    p = make_problem(CASE, seed=3, precision="fp8", minibatch_rows=128, ring_rows=None)
    x, ids, tw, dy = p.single
    moe = megamoe.MoE(p.config, backend="triton", seed=3)
    views = optim.fp8_weight_views(torch.nn.Sequential(moe))
    assert len(views) == 6
    opt = optim.AdamW(moe.parameters(), LR, BETAS, EPS, WD, fp8_views=views)
    cache = fp8_weights.CACHE

    def step() -> list[torch.Tensor]:
        moe.zero_grad(set_to_none=True)
        y = moe(x, ids, tw)
        y.backward(dy)
        return [y.detach()] + [w.grad.clone() for w in moe.parameters()]

    fp8_weights.clear()
    step()
    opt.step()
    count = cache.quantizations
    got = step()
    assert cache.quantizations == count  # every weight's copy came from the update
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    torch.optim.SGD([other], lr=0.1).step()  # (empties the cache of all but the update's)
    assert len(cache) == 6
    cache.clear()
    want = step()
    assert cache.quantizations == count + 6
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    opt.step()
    with torch.no_grad():
        moe.w_down.mul_(0.5)  # (bumps its version: its copy is stale)
    step()
    assert cache.quantizations == count + 7


def test_views_of_the_transformers_integration() -> None:
    """A transformers experts module on a megamoe fp8 key: its stacked gate/up weight's halves
    and its down weight; none on a bf16 key."""
    pytest.importorskip("transformers")
    from megamoe.integrations import transformers as mt

    class Config:
        _experts_implementation = mt.experts_implementation("triton", "fp8")

    experts = torch.nn.Module()
    experts.config = Config()
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 2 * 32, 16))
    experts.down_proj = torch.nn.Parameter(torch.zeros(4, 16, 32))
    views = optim.fp8_weight_views(torch.nn.Sequential(experts))
    assert [tuple(v.shape) for v in views] == [(4, 32, 16), (4, 32, 16), (4, 16, 32)]
    optim.AdamW(experts.parameters(), fp8_views=views)  # (they cover both parameters)
    Config._experts_implementation = mt.experts_implementation("triton", "bf16")
    assert optim.fp8_weight_views(torch.nn.Sequential(experts)) == []


def test_errors() -> None:
    w = torch.nn.Parameter(torch.zeros(2, 8, 16))
    for kwargs, match in (
        (dict(lr=-1.0), "lr must be a float >= 0, got -1.0"),
        (dict(betas=(1.0, 0.9)), r"betas\[0\] must be a float in \[0, 1\), got 1.0"),
        (dict(eps=-1.0), "eps must be"),
        (dict(weight_decay=-0.1), "weight_decay must be"),
        (dict(fp8_views=[torch.zeros(2, 8, 16)]), r"fp8_views\[0\] \(shape \[2, 8, 16\]"),
        (dict(fp8_views=[w[0]]), r"fp8_views\[0\] must be a 3-D \[E, N, K\] tensor, got \[8, 16\]"),
        (dict(fp8_views=[w[:, :4]]), r"cover rows \[\(0, 4\)\]: they must cover each row once"),
        (dict(fp8_views=[w[:, :4], w[:, :4]]), "cover each row once"),
    ):
        with pytest.raises(ValueError, match=match):
            optim.AdamW([w], **kwargs)
    with pytest.raises(ValueError, match=r"lr must be a float >= 0, got tensor\(0.1000\)"):
        optim.AdamW([w], lr=torch.tensor(0.1))
    opt = optim.AdamW([w])
    opt.param_groups[0]["lr"] = torch.tensor(0.1)  # (as a scheduler could set it)
    w.grad = torch.zeros_like(w)
    with pytest.raises(ValueError, match="lr must be a float, got a tensor"):
        opt.step()
    with pytest.raises(ValueError, match="grad must have the parameter's shape"):
        adamw.adamw_(w.detach(), torch.zeros(3), torch.zeros_like(w), torch.zeros_like(w),
                     adamw.AdamWStep(LR, *BETAS, EPS, WD, step=1))  # fmt: skip
    with pytest.raises(ValueError, match="param must be contiguous"):
        t = torch.zeros(16, 8).t()
        adamw.adamw_(t, *(torch.zeros(16, 8).t() for _ in range(3)),
                     adamw.AdamWStep(LR, *BETAS, EPS, WD, step=1))  # fmt: skip
    with pytest.raises(ValueError, match=r"fp8 weight put needs|put needs an Fp8Weight"):
        fp8_weights.CACHE.put(w, fp8.Fp8Weight(None, None))
