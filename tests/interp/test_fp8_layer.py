"""The layer with ``MoEConfig(precision="fp8")`` on backend "triton" under the interpreter.

Checked: the output and every gradient against a float64 emulation of the quantized recipe
(the same 1x128 / 128x1 / 128x128 quantization in torch ops, the same bf16 roundings of the
saved activations, every product in float64) and against the float64 layer on the unquantized
inputs; the same bits run to run, for a stacked gate/up weight, and at W = 2, 3 and 8
(lockstep), where the dispatch and the dy pull move packed fp8 rows; backend "reference"'s fp8
recipe against the same emulation; every output written (poisoned buffers); the backward
quantizes d_z, d_g and d_u by one pass each; the weight cache quantizes each weight once per
version and optimizer step, checks the storage, and is off for FSDP-sharded weights; the
errors.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import megamoe
from megamoe import functional
from megamoe.backends import fp8_weights
from megamoe.backends import triton as backend
from megamoe.config import TUNABLES, MoEConfig
from megamoe.kernels import comm, fp8
from megamoe.kernels import rows as kernel_rows
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.types import ExpertWeights, MoEGrads
from support.lockstep import ep_against_single_process
from support.oracle import reference_grads, rel_err
from support.problems import Case, make_problem, params
from support.procs import run_gloo

FP8 = dict(precision="fp8", minibatch_rows=128, ring_rows=None)
# H 144: a partial 128 block along K; T 40: the shared expert's token count is no multiple of 16.
CASE = Case(40, 144, 112, 4, 2, shared=48, block_rows=128)
CPU = torch.device("cpu")

# Bars against the float64 layer on the unquantized bf16 inputs. E4M3 keeps 3 mantissa bits
# (a relative rounding error of about 2.6% rms per operand), and y goes through two quantized
# GEMMs with two quantized operands each: these shapes measure 6.6-6.9% on y (four seeds) and
# cosines of 0.9975 on every gradient.
Y_REL_L2 = 8e-2
GRAD_COSINE = 0.996
# Against the emulated recipe: what is left is fp32 against float64 accumulation and the bf16
# output roundings (1.6e-3 to 1.7e-3 measured on every output of the layer, up to 2.1e-3 on
# backend "reference"'s d_x, seeds 0-3 and 11-14); a wrong scale, block or operand is several
# percent (the unquantized dy in the route grad: 3-6% on the routed gradients).
RECIPE_REL_L2 = 3e-3


def _problem(case: Case = CASE, seed: int = 0):
    return make_problem(case, seed=seed, **FP8)


# --------------------------------------------------------------------------------------------
# The recipe in torch ops (float64)


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax / 448)), the exponent at least -126; 1 for a zero block (float64)."""
    mant, exp = torch.frexp(amax / 448.0)
    exp = torch.where(mant == 0.5, exp - 1, exp).clamp(min=-126)
    return torch.where(amax == 0, 1.0, torch.ldexp(torch.ones_like(amax), exp))


def _blocks(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [M, K] dequantized from blocks of ``rows`` x 128 (1 or 128 rows), float64."""
    m, k = x.shape
    mb, kb = math.ceil(m / rows), math.ceil(k / 128)
    xp = F.pad(x.float(), (0, kb * 128 - k, 0, mb * rows - m)).view(mb, rows, kb, 128)
    scale = _pow2_scale(xp.abs().amax(dim=(1, 3), keepdim=True).double()).float()
    q = (xp / scale).to(torch.float8_e4m3fn)
    return (q.double() * scale.double()).reshape(mb * rows, kb * 128)[:m, :k]


def _rows(x: torch.Tensor) -> torch.Tensor:  # 1x128 along K
    return _blocks(x, 1)


def _cols(x: torch.Tensor) -> torch.Tensor:  # 128x1 along the rows (at most 128 rows here)
    assert x.shape[0] <= 128
    return _blocks(x.t(), 1).t()


def _weight(w: torch.Tensor) -> torch.Tensor:  # 128x128
    return _blocks(w, 128)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _expert(x, dz, w_gate, w_up, w_down):
    """(z, d_x rows, d_W_gate, d_W_up, d_W_down) of one expert's rows, as the kernels compute
    them (d_z given)."""
    wg, wu, wd = _weight(w_gate), _weight(w_up), _weight(w_down)
    g, u = _rows(x) @ wg.t(), _rows(x) @ wu.t()
    gb, ub, hb = _bf16(g), _bf16(u), _bf16(F.silu(g) * u)
    z = _bf16(_rows(hb) @ wd.t())
    dh = _rows(dz) @ wd
    sig = torch.sigmoid(gb)
    dg, du = _bf16(dh * ub * sig * (1 + gb * (1 - sig))), _bf16(dh * gb * sig)
    dx = _bf16(_rows(dg) @ wg + _rows(du) @ wu)
    xc = _cols(_rows(x))  # re-blocked from x's 1x128 quantization (the dispatched rows)
    dw = (_cols(dg).t() @ xc, _cols(du).t() @ xc, _cols(dz).t() @ _cols(hb))
    return z, dx, *dw


def recipe(p) -> tuple[torch.Tensor, MoEGrads]:
    """y and the gradients of the fp8 layer at W = 1, emulated in float64. The routed experts'
    dz = w * dy and d topk_weights = <dy, z> read dy quantized 1x128 (the packed rows the dy
    pull moves); the shared expert reads the bf16 dy."""
    x, ids, tw, dy = p.single
    w = p.weights
    dy_routed = _rows(dy)
    t, h = x.shape
    y, dx = torch.zeros(t, h, dtype=torch.float64), torch.zeros(t, h, dtype=torch.float64)
    d_tw = torch.zeros(tw.shape, dtype=torch.float64)
    d_w = [torch.zeros(wt.shape, dtype=torch.float64) for wt in w[:3]]
    for e in range(p.config.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        dz = _bf16(tw[tok, slot, None].double() * dy_routed[tok])
        z, dxs, *dwe = _expert(x[tok], dz, w.w_gate[e], w.w_up[e], w.w_down[e])
        y.index_add_(0, tok, tw[tok, slot, None].double() * z)
        dx.index_add_(0, tok, dxs)
        d_tw[tok, slot] = (dy_routed[tok] * z).sum(1)
        for acc, d in zip(d_w, dwe):
            acc[e] = d
    zs, dxs, *d_s = _expert(x, dy.double(), w.s_gate, w.s_up, w.s_down)
    return y + zs, MoEGrads(dx + dxs, d_tw, *d_w, *d_s)


# --------------------------------------------------------------------------------------------
# Running the layer


def _moe(
    p, weights: ExpertWeights | None = None, backend: str = "triton"
) -> tuple[torch.Tensor, MoEGrads]:
    """functional.moe (the custom ops) forward and backward, every buffer poisoned."""
    x, ids, tw, dy = p.single
    weights = weights or p.weights
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, tw)]
    weights = ExpertWeights(
        *(None if t is None else t.detach().requires_grad_(True) for t in weights)
    )
    present = leaves + [t for t in weights if t is not None]
    with poisoned_buffers():
        y = functional.moe(leaves[0], ids, leaves[1], weights, p.config, backend=backend)
        found = iter(torch.autograd.grad(y, present, dy))
    return y.detach(), MoEGrads(*(None if t is None else next(found) for t in leaves + [*weights]))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def test_fp8_layer_against_the_recipe_and_the_float64_layer() -> None:
    p = _problem()
    y, grads = _moe(p)
    again = _moe(p)
    ref_y, ref = reference_grads(p, torch.float64)
    rec_y, rec = recipe(p)
    # the same dtypes as the bf16 layer, every element written (poisoned buffers give NaN)
    bf16_y, bf16 = _moe(make_problem(CASE, seed=0, minibatch_rows=128, ring_rows=None))
    assert y.dtype == bf16_y.dtype and torch.isfinite(y).all()
    assert rel_err(y, rec_y) <= RECIPE_REL_L2, rel_err(y, rec_y)
    assert rel_err(y, ref_y) <= Y_REL_L2, rel_err(y, ref_y)
    assert rel_err(bf16_y, ref_y) < 1e-2  # (the bf16 layer: the quantization is the error)
    for name, a, r, o, b in zip(MoEGrads._fields, grads, rec, ref, bf16):
        assert a.dtype == b.dtype and a.shape == o.shape, name
        assert torch.isfinite(a).all(), f"{name}: unwritten or non-finite"
        assert rel_err(a, r) <= RECIPE_REL_L2, f"{name}: {rel_err(a, r):.3e} from the recipe"
        assert _cosine(a, o) >= GRAD_COSINE, f"{name}: cosine {_cosine(a, o):.5f}"
    # bitwise run to run (the second run read the cached weights)
    assert torch.equal(y, again[0])
    for name, a, b in zip(MoEGrads._fields, grads, again[1]):
        assert torch.equal(a, b), name
    # a stacked [E, 2I, H] gate/up weight: its halves quantized in place, the same bits
    w = p.weights
    stacked = ExpertWeights.from_gate_up(torch.cat([w.w_gate, w.w_up], 1), *w[2:])
    y2, g2 = _moe(p, stacked)
    assert torch.equal(y, y2)
    i = CASE.intermediate
    assert torch.equal(g2.w_gate[:, :i], grads.w_gate) and torch.equal(g2.w_gate[:, i:], grads.w_up)
    for name in ("x", "topk_weights", "w_down", "s_gate", "s_up", "s_down"):
        assert torch.equal(getattr(g2, name), getattr(grads, name)), name


def test_backend_reference_runs_the_recipe() -> None:
    p = _problem()
    y, grads = _moe(p, backend="reference")
    rec_y, rec = recipe(p)
    ref_y, _ = reference_grads(p, torch.float64)
    assert rel_err(y, rec_y) <= RECIPE_REL_L2, rel_err(y, rec_y)
    assert rel_err(y, ref_y) > 2e-2  # (quantized: far from the unquantized layer)
    for name, a, r in zip(MoEGrads._fields, grads, rec):
        assert rel_err(a, r) <= RECIPE_REL_L2, f"{name}: {rel_err(a, r):.3e} from the recipe"


def test_fp8_layer_with_an_empty_expert_and_experts_of_several_blocks() -> None:
    # 200 tokens, top-2 over experts 0-2 only: about 133 rows each (two 128-row blocks, the
    # weight gradient's 128x1 scales over two blocks) and expert 3 without rows
    p = _problem(Case(200, 128, 64, 4, 2, routing="empty_experts", block_rows=128), seed=5)
    assert (p.topk_ids == 3).sum() == 0 and max((p.topk_ids == e).sum() for e in range(3)) > 128
    y, grads = _moe(p)
    ref_y, ref = reference_grads(p, torch.float64)
    assert rel_err(y, ref_y) <= Y_REL_L2, rel_err(y, ref_y)
    for name, a, o in zip(MoEGrads._fields, grads, ref):
        if o is None:
            continue
        assert torch.isfinite(a).all(), f"{name}: unwritten or non-finite"
        assert _cosine(a, o) >= GRAD_COSINE, f"{name}: cosine {_cosine(a, o):.5f}"
    for name in ("w_gate", "w_up", "w_down"):
        assert (getattr(grads, name)[3] == 0).all(), f"{name}: the empty expert's gradient"


# (the cache's counts and bits do not depend on the shape: two experts, one 128-row block each)
CACHE_CASE = Case(12, 32, 32, 2, 1, shared=16, block_rows=128)


def test_weight_cache_quantizes_once_per_weight_version() -> None:
    p = _problem(CACHE_CASE, seed=1)
    moe = megamoe.MoE(p.config, backend="triton", seed=3)
    opt = torch.optim.SGD(moe.parameters(), lr=0.01)
    x, ids, tw, dy = p.single
    cache = fp8_weights.CACHE

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        moe.zero_grad(set_to_none=True)
        with poisoned_buffers():
            y = moe(x, ids, tw)
            y.backward(dy)
        return y.detach(), [q.grad.clone() for q in moe.parameters()]

    count = cache.quantizations
    first = step()
    assert cache.quantizations - count == 6  # three routed and three shared weights
    assert torch.equal(step()[0], first[0])  # (same weights: no quantization, same bits)
    assert cache.quantizations - count == 6
    opt.step()  # in place: bumps every parameter's version
    after = step()
    assert cache.quantizations - count == 12
    assert not torch.equal(after[0], first[0])
    cache.clear()  # from scratch: the requantized copies were those of the updated weights
    fresh = step()
    assert cache.quantizations - count == 18
    assert torch.equal(fresh[0], after[0])
    for a, b in zip(fresh[1], after[1]):
        assert torch.equal(a, b)


def test_weight_cache_checks_the_storage_and_empties_at_optimizer_steps() -> None:
    """Writes the version counter does not see: a new storage at a cached one's address (as
    after FSDP2 frees its gathered weights) misses, and an optimizer step empties the cache,
    so a weight FSDP2 rewrote with its version preserved is quantized again."""
    import numpy as np

    cache = fp8_weights.Fp8WeightCache()
    values = np.random.default_rng(0).standard_normal((2, 128, 128), dtype=np.float32)
    first = torch.from_numpy(values)
    old = cache.get(first)
    values *= 3  # (through numpy: no version bump)
    second = torch.from_numpy(values)  # the same address and version, another storage
    assert second.data_ptr() == first.data_ptr() and second._version == first._version
    got = cache.get(second)
    assert got is not old and cache.quantizations == 2
    assert torch.equal(got.q_t.float(), fp8.quantize_weight(second, transposed=True).q_t.float())

    w = torch.randn(2, 128, 128).to(torch.bfloat16)
    old = cache.get(w)
    assert cache.get(w) is old
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
        w.mul_(-2)  # FSDP2's all-gather copy-out: new values, the version kept
    shard = torch.nn.Parameter(torch.ones(3))
    shard.grad = torch.ones(3)
    torch.optim.SGD([shard], lr=0.1).step()  # (any optimizer: it may step FSDP's shards)
    assert len(cache) == 0
    got = cache.get(w)
    fresh = fp8.quantize_weight(w, transposed=True)
    for a, b in zip(got, fresh, strict=True):
        assert torch.equal(a.float(), b.float())


def test_without_the_weight_cache_nothing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fp8_weight_cache=False`` (weights gathered per call): the forward quantizes each weight
    in the layout it reads and keeps no copy, not even for its backward (no transposed copies in
    the saved tensors), and the backward quantizes each weight once again, only its transposed
    copy; the step has the cached step's bits, also through the saved tensors."""
    p = _problem(CACHE_CASE, seed=4)
    x, ids, tw, dy = p.single
    made: list[tuple[str, ...]] = []  # the layouts each quantization wrote

    def quantize_weight(w, *args, _fn=fp8.quantize_weight, **kwargs):
        got = _fn(w, *args, **kwargs)
        made.append(tuple(n for n, t in zip(got._fields, got) if t is not None))
        return got

    monkeypatch.setattr(fp8, "quantize_weight", quantize_weight)
    both, plain, transposed = ("q", "scale", "q_t", "scale_t"), ("q", "scale"), ("q_t", "scale_t")
    runs = []
    for keep in (True, False):
        cfg = dataclasses.replace(p.config, fp8_weight_cache=keep)
        fp8_weights.clear()
        made.clear()
        sched = backend.build_schedule(ids, cfg, None)
        with poisoned_buffers():
            y, ctx = backend.forward(x, ids, tw, p.weights, cfg, None, sched)
            assert (ctx.fp8 is not None) == keep
            assert made == [both if keep else plain] * 6
            saved = backend.save(ctx)
            layout = backend.saved_layout(cfg, x.shape[0], 1, x.dtype)
            assert [tuple(t.shape) for t in saved] == [shape for _, shape, _ in layout]
            assert any(n.startswith("fp8_") for n, _, _ in layout) == keep
            restored = backend.restore(saved, x, ids, tw, p.weights, cfg, None)
            grads = backend.backward(restored, dy)
        # (the backward's: once for both GEMM kinds, the transposed copies alone)
        assert made[6:] == ([] if keep else [transposed] * 6)
        assert len(fp8_weights.CACHE) == (6 if keep else 0)
        runs.append((y, *(g for g in grads if g is not None)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _fsdp_worker(rank: int, world_size: int) -> None:
    """One gloo rank: ``fully_shard`` a fp8 MoE, train a step, step the optimizer, and the next
    forward reads the updated weights: the output of an unsharded MoE holding them, with
    nothing cached. (The CPU allocator gives FSDP's gathered weights a new address, so stale
    copies would not show here; tests/gpu/test_fp8.py has the case where CUDA's gives it back.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    p = _problem(CACHE_CASE, seed=5)
    x, ids, tw, dy = p.single
    moe = megamoe.MoE(p.config, backend="triton", seed=3)
    fully_shard(moe, mesh=init_device_mesh("cpu", (world_size,)), reshard_after_forward=False)
    assert fp8_weights.gathered_per_call(moe)
    opt = torch.optim.SGD(moe.parameters(), lr=0.5)
    count = fp8_weights.CACHE.quantizations
    moe(x, ids, tw).backward(dy)
    opt.step()
    after = moe(x, ids, tw).detach()
    assert fp8_weights.CACHE.quantizations == count  # not cached: gathered for each forward
    plain = megamoe.MoE(p.config, backend="triton", seed=0)
    moe.reshard()  # (the parameters back to their shards: DTensors)
    with torch.no_grad():
        for q, src in zip(plain.parameters(), moe.parameters(), strict=True):
            q.copy_(src.full_tensor())
    assert torch.equal(after, plain(x, ids, tw).detach())


def test_fsdp2_sharded_weights_are_quantized_after_each_optimizer_step() -> None:
    run_gloo(1, _fsdp_worker)


def test_a_captured_step_quantizes_each_weight_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a CUDA graph is captured the cache is bypassed (a replay must read the weights'
    current values), so each use quantizes: the forward takes the step's copies once and the
    backward reads the transposed ones from the context (with ``megamoe.ops``' custom ops, from
    its saved tensors), with the bits of a step on cached copies."""
    p = _problem(CACHE_CASE, seed=2)
    x, ids, tw, dy = p.single
    sched = backend.build_schedule(ids, p.config, None)

    def step() -> tuple[torch.Tensor, ...]:
        with poisoned_buffers():
            y, ctx = backend.forward(x, ids, tw, p.weights, p.config, None, sched)
            saved = backend.save(ctx)
            restored = backend.restore(saved, x, ids, tw, p.weights, p.config, None)
            grads = backend.backward(restored, dy)
        return (y, *(g for g in grads if g is not None))

    fp8_weights.clear()
    cached = step()
    made: list[tuple[int, ...]] = []

    def quantize_weight(w, *args, _fn=fp8.quantize_weight, **kwargs):
        made.append(tuple(w.shape))
        return _fn(w, *args, **kwargs)

    monkeypatch.setattr(fp8, "quantize_weight", quantize_weight)
    monkeypatch.setattr(fp8_weights, "capturing", lambda w: True)
    captured = step()
    e, h, i, s = (
        CACHE_CASE.local_experts,
        CACHE_CASE.hidden,
        CACHE_CASE.intermediate,
        CACHE_CASE.shared,
    )
    assert sorted(made) == sorted(
        [(e, i, h), (e, i, h), (e, h, i), (1, s, h), (1, s, h), (1, h, s)]
    )
    for a, b in zip(captured, cached, strict=True):
        assert torch.equal(a, b)


def test_each_activation_and_gradient_is_quantized_by_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """h feeds the down GEMM (1x128) and the weight gradient of down (128x1): the forward
    quantizes it both ways by one quantize_rows_cols pass and keeps only the 128x1 copy for
    the backward. d_z, d_g and d_u each feed a data gradient and a weight gradient: the route
    grad writes d_z's two quantizations itself (``quantize=True``, d_z never in bf16), the
    backward quantizes d_g and d_u by one quantize_rows_cols pass each (together where their
    rows are whole 128-row blocks), and nothing by quantize_rows or quantize_cols. (Here, in
    the interpreter; on Hopper the gate/up and SwiGLU-backward epilogues quantize h, d_g and
    d_u instead of these passes, with their bits: tests/gpu/test_fp8.py.)"""
    p = _problem()
    x, ids, tw, dy = p.single
    sched = backend.build_schedule(ids, p.config, None)
    calls: list[tuple[str, tuple[int, ...]]] = []
    for name in ("quantize_rows", "quantize_cols", "quantize_rows_cols"):

        def recording(src, *args, _name=name, _fn=getattr(fp8, name), **kwargs):
            calls.append((_name, tuple(src.shape)))
            return _fn(src, *args, **kwargs)

        monkeypatch.setattr(fp8, name, recording)
    _, ctx = backend.forward(x, ids, tw, p.weights, p.config, None, sched)
    rows, t = sched.routed.rows, CASE.tokens
    h, i, s = CASE.hidden, CASE.intermediate, CASE.shared
    assert sorted(calls) == sorted(
        [("quantize_rows_cols", (rows, i)), ("quantize_rows_cols", (t, s))]  # h, shared h
    ), calls
    assert ctx.routed.h.dtype == torch.int16 and ctx.shared.h.dtype == torch.int16  # packed
    calls.clear()
    route_grads = []

    def route_grad(*args, _fn=kernel_rows.route_grad, **kwargs):
        route_grads.append(kwargs.get("quantize"))
        return _fn(*args, **kwargs)

    monkeypatch.setattr(kernel_rows, "route_grad", route_grad)
    backend.backward(ctx, dy)
    assert route_grads == [True]
    assert rows % 128 == 0 and t % 128  # the shared expert's d_g, d_u: one pass each
    assert sorted(calls) == sorted(
        [
            ("quantize_rows_cols", (2 * rows, i)),  # d_g and d_u
            ("quantize_rows_cols", (t, h)),  # the shared expert's d_z: d_y
            ("quantize_rows_cols", (t, s)),  # its d_g
            ("quantize_rows_cols", (t, s)),  # its d_u
        ]
    ), calls


EP_CASES = [
    Case(20, 128, 64, 4, 2, shared=32, world=2, block_rows=128),
    Case(12, 128, 48, 6, 2, world=3, block_rows=128),
    Case(4, 128, 32, 8, 2, routing="zipf", world=8, block_rows=128),  # one expert per rank
]


def _ep_against_single_process(case: Case):
    """``ep_against_single_process`` of backend "triton" on ``case``; returns the problem, the
    ranks' (y, ctx, grads) and the single process's context."""
    p = _problem(case, seed=EP_CASES.index(case))
    with poisoned_buffers():
        out, ctx1 = ep_against_single_process(p, poison_slots=False)
    return p, out, ctx1


def _packed_rows_of_their_tokens(xs: torch.Tensor, sched, tokens: torch.Tensor) -> None:
    """``xs`` holds packed fp8 rows (not bf16): each real row is its token's packed 1x128
    quantization, padding rows zeros."""
    assert xs.dtype == torch.int16 and xs.shape == (sched.rows, fp8.packed_width(tokens.shape[1]))
    used = int(sched.num_blocks) * sched.block_rows
    slots = sched.row_src[:used].long()
    real = slots >= 0
    assert torch.equal(xs[:used][real], fp8.quantize_packed(tokens)[slots[real] // sched.top_k])
    assert (xs[:used][~real] == 0).all()


def test_the_dispatch_moves_packed_fp8_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """In fp8 every rank publishes its tokens and its dy quantized 1x128 and packed, the
    dispatch and the dy pull move those int16 words (a row's fp8 bytes and scales: 64 + 2 words
    padded to 80 at H 128, where bf16 takes 128; at dsv3's H 7168, 3696 against 7168), the
    routed GEMMs and the route grad read them in place, and W = 2 gives the bits of W = 1,
    whose gather moves the same packed rows of x (and whose route grad reads dy's by token)."""
    pulls = []
    pull = comm.dispatch_pull

    def recording(ws, sched, source="x", *args, **kwargs):
        out = pull(ws, sched, source, *args, **kwargs)
        pulls.append((source, kwargs.get("packed_width"), out))
        return out

    monkeypatch.setattr(comm, "dispatch_pull", recording)
    case = EP_CASES[0]
    p, out, ctx1 = _ep_against_single_process(case)
    x_pulls = [(w, o) for source, w, o in pulls if source == "x"]
    assert len(x_pulls) == case.world
    all_x = p.single.x
    for r, ((width, pulled), (_, ctx, _)) in enumerate(zip(x_pulls, out)):
        assert width == fp8.packed_width(case.hidden), f"rank {r}"
        assert ctx.routed.xs is pulled  # the GEMMs' input rows are the pulled words
        _packed_rows_of_their_tokens(pulled, ctx.schedule.routed, all_x)
        bf16_bytes = ctx.schedule.routed.rows * case.hidden * 2
        assert pulled.numel() * 2 <= 0.65 * bf16_bytes
    _packed_rows_of_their_tokens(ctx1.routed.xs, ctx1.schedule.routed, all_x)  # W = 1: gathered
    dy_pulls = [(w, o) for source, w, o in pulls if source == "dy"]
    assert len(dy_pulls) == case.world
    for r, ((width, pulled), (_, ctx, _)) in enumerate(zip(dy_pulls, out)):
        assert width == fp8.packed_width(case.hidden), f"rank {r}"
        _packed_rows_of_their_tokens(pulled, ctx.schedule.routed, p.single.grad_y)
        assert pulled.numel() * 2 <= 0.65 * ctx.schedule.routed.rows * case.hidden * 2


@pytest.mark.parametrize("case", params(*EP_CASES[1:]))
def test_expert_parallel_fp8_is_bitwise_single_process(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    widths = []
    pull = comm.dispatch_pull

    def recording(ws, sched, source="x", *args, **kwargs):
        widths.append((source, kwargs.get("packed_width")))
        return pull(ws, sched, source, *args, **kwargs)

    monkeypatch.setattr(comm, "dispatch_pull", recording)
    _ep_against_single_process(case)
    # every pull, of x and of dy, moved packed fp8 rows
    width = fp8.packed_width(case.hidden)
    assert sorted(widths) == [("dy", width)] * case.world + [("x", width)] * case.world


# --------------------------------------------------------------------------------------------
# Config and errors


def _config(**changes) -> MoEConfig:
    return MoEConfig(**{**dict(hidden_size=128, intermediate_size=64, num_experts=4, top_k=2),
                        **changes})  # fmt: skip


def test_precision_is_part_of_the_key_and_not_a_tunable() -> None:
    assert _config().precision == "bf16"
    cfg = _config(precision="fp8", shared_intermediate_size=32)
    assert MoEConfig.from_key(cfg.key) == cfg and MoEConfig.from_key(cfg.key).precision == "fp8"
    assert cfg.key != cfg.replace(precision="bf16").key
    assert "precision" not in TUNABLES


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(precision="fp16"), r"precision must be one of \['bf16', 'fp8'\], got 'fp16'"),
        (dict(precision=None), "precision must be one of"),
        (dict(precision="fp8", block_rows=64, minibatch_rows=64), "block_rows to be a multiple"),
        (dict(precision="fp8", hidden_size=136), "hidden_size to be a multiple of 16"),
        (dict(precision="fp8", intermediate_size=72), "intermediate_size to be a multiple of 16"),
        (dict(precision="fp8", shared_intermediate_size=40), "shared_intermediate_size to be"),
    ],
)
def test_precision_errors(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**changes)
