"""Every bad input raises an error that names the argument, the value seen and what was expected."""

from __future__ import annotations

import pytest
import torch

from megamoe import ExpertWeights, MoE, MoEConfig, TopKRouter, functional
from support.problems import Case, make_problem

CFG = MoEConfig(64, 32, 4, 2, shared_intermediate_size=16)
T = 8


def _inputs():
    p = make_problem(Case(T, 64, 32, 4, 2, shared=16), seed=0)
    return p.x, p.topk_ids, p.topk_weights, p.weights


def _call(x=None, ids=None, tw=None, weights=None, cfg=CFG):
    x0, ids0, tw0, w0 = _inputs()
    return functional.forward(
        x if x is not None else x0,
        ids if ids is not None else ids0,
        tw if tw is not None else tw0,
        weights or w0,
        cfg,
    )


def test_valid_inputs_pass():
    y, _ = _call()
    assert y.shape == (T, 64) and torch.isfinite(y.float()).all()


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (
            lambda x, i, w: dict(x=x.float()),
            TypeError,
            r"x must have the dtype of the layer's weights \(bfloat16\), got float32",
        ),
        (
            lambda x, i, w: dict(x=x[:, :60].contiguous()),
            ValueError,
            r"x must have shape \[tokens, 64\], got \[8, 60\]",
        ),
        (lambda x, i, w: dict(x=x.t().contiguous().t()), ValueError, r"x must be contiguous"),
        (lambda x, i, w: dict(x=x.to(torch.int32)), TypeError, r"x must be a floating tensor"),
        (
            lambda x, i, w: dict(ids=i.float()),
            TypeError,
            r"topk_ids must have dtype in \(int32, int64\), got float32",
        ),
        (
            lambda x, i, w: dict(ids=i[:, :1]),
            ValueError,
            r"topk_ids must have shape \[8, 2\], got \[8, 1\]",
        ),
        (
            lambda x, i, w: dict(ids=i[:5]),
            ValueError,
            r"topk_ids must have shape \[8, 2\], got \[5, 2\]",
        ),
        (
            lambda x, i, w: dict(ids=torch.where(torch.arange(T)[:, None] == 3, 4, i)),
            ValueError,
            r"topk_ids must be in \[0, 4\), got 4 \(token 3\)",
        ),
        (
            lambda x, i, w: dict(ids=torch.where(torch.arange(T)[:, None] == 5, -1, i)),
            ValueError,
            r"topk_ids must be in \[0, 4\), got -1 \(token 5\)",
        ),
        (
            lambda x, i, w: dict(ids=torch.where(torch.arange(T)[:, None] == 2, 1, i)),
            ValueError,
            r"topk_ids must hold distinct experts per token, got \[1, 1\] for token 2",
        ),
        (
            lambda x, i, w: dict(tw=w.double()),
            TypeError,
            r"topk_weights must have dtype in \(float32\), got float64",
        ),
        (
            lambda x, i, w: dict(tw=torch.where(torch.arange(T)[:, None] == 6, float("nan"), w)),
            ValueError,
            r"topk_weights must be finite, got \[nan, nan\] for token 6",
        ),
        (
            lambda x, i, w: dict(tw=torch.where(torch.arange(T)[:, None] == 1, float("inf"), w)),
            ValueError,
            r"topk_weights must be finite, got \[inf, inf\] for token 1",
        ),
    ],
)
def test_bad_inputs(make, error, pattern):
    x, ids, tw, _ = _inputs()
    with pytest.raises(error, match=pattern):
        _call(**make(x, ids, tw))


def test_bad_weights():
    x, ids, tw, w = _inputs()
    with pytest.raises(
        ValueError, match=r"w_down must have shape \[4, 64, 32\], got \[4, 32, 64\]"
    ):
        _call(weights=w._replace(w_down=w.w_down.transpose(1, 2)))
    with pytest.raises(ValueError, match="s_gate, s_up and s_down are required"):
        _call(weights=w._replace(s_gate=None, s_up=None, s_down=None))
    with pytest.raises(ValueError, match="shared expert weights given"):
        _call(weights=w, cfg=CFG.replace(shared_intermediate_size=0))
    with pytest.raises(TypeError, match="w_up must have dtype in \\(bfloat16\\), got float32"):
        _call(weights=w._replace(w_up=w.w_up.float()))
    with pytest.raises(TypeError, match="w_gate must be a torch.Tensor, got list"):
        _call(weights=ExpertWeights([1], w.w_up, w.w_down, *w[3:]))


def test_value_checks_can_be_skipped():
    x, ids, tw, w = _inputs()
    tw = tw.clone()
    tw[0, 0] = float("nan")
    y, _ = functional.forward(x, ids, tw, w, CFG, check_values=False)
    assert torch.isnan(y[0].float()).all() and torch.isfinite(y[1:].float()).all()


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(hidden_size=0), ValueError, "hidden_size must be >= 1, got 0"),
        (dict(hidden_size=64.0), TypeError, r"hidden_size must be an int, got 64.0 \(float\)"),
        (dict(top_k=5), ValueError, r"top_k must be <= num_experts \(4\), got 5"),
        (
            dict(shared_intermediate_size=-1),
            ValueError,
            "shared_intermediate_size must be >= 0, got -1",
        ),
        (dict(block_rows=96), ValueError, "block_rows must be a power of two, got 96"),
        (
            dict(minibatch_rows=200),
            ValueError,
            r"minibatch_rows must be a multiple of block_rows \(128\), got 200",
        ),
        (
            dict(ring_rows=3000),
            ValueError,
            r"ring_rows must be a multiple of minibatch_rows \(1024\), got 3000",
        ),
        (dict(comm_programs=0), ValueError, "comm_programs must be >= 1, got 0"),
        (dict(copy_programs=0), ValueError, "copy_programs must be >= 1, got 0"),
        (dict(down_lag=-1), ValueError, "down_lag must be >= 0, got -1"),
        (dict(overlap_shared=2), ValueError, r"overlap_shared must be a bool \(or 0 / 1\), got 2"),
        (
            dict(overlap_shared=None),
            TypeError,
            r"overlap_shared must be a bool \(or 0 / 1\), got None",
        ),
        (dict(comm_kernel=2), ValueError, r"comm_kernel must be a bool \(or 0 / 1\), got 2"),
        (dict(comm_kernel="on"), TypeError, r"comm_kernel must be a bool \(or 0 / 1\), got 'on'"),
        (
            dict(capacity_factor=0.5),
            ValueError,
            "capacity_factor must be a number >= 1.0 or None, got 0.5",
        ),
    ],
)
def test_config_validation(kwargs, error, pattern):
    base = dict(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2)
    with pytest.raises(error, match=pattern):
        MoEConfig(**{**base, **kwargs})


def test_bool_tunables_take_0_and_1_as_bools():
    base = dict(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2)
    assert MoEConfig(**base, overlap_shared=0).overlap_shared is False
    assert MoEConfig(**base, overlap_shared=1) == MoEConfig(**base)
    assert MoEConfig(**base, comm_kernel=1).comm_kernel is True
    assert MoEConfig(**base).comm_kernel is None  # resolved per world size by backend "fused"


def test_config_world_size_and_capacity():
    cfg = MoEConfig(64, 32, 6, 2, capacity_factor=1.5)
    assert cfg.local_experts(3) == 2
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible .* world_size=4"):
        cfg.local_experts(4)
    assert cfg.capacity_rows(100, 3) == 300
    assert cfg.replace(capacity_factor=None).capacity_rows(100, 3) == 600


def test_module_arguments():
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'cuda'"):
        MoE(CFG, backend="cuda")
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype .*got torch.int32"):
        MoE(CFG, dtype=torch.int32)
    with pytest.raises(TypeError, match="config must be a MoEConfig, got dict"):
        MoE({"hidden_size": 64})
    with pytest.raises(ValueError, match="score_func must be one of"):
        TopKRouter(64, 4, 2, score_func="relu")
    with pytest.raises(ValueError, match=r"top_k must be <= num_experts \(4\), got 8"):
        TopKRouter(64, 4, 8)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router(score_func, renormalize):
    torch.manual_seed(0)
    router = TopKRouter(
        64, 8, 3, score_func=score_func, renormalize=renormalize, dtype=torch.float32
    )
    x = torch.randn(20, 64)
    ids, w = router(x)
    assert ids.shape == (20, 3) and w.dtype == torch.float32
    logits = x @ router.gate.weight.t()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    assert torch.equal(ids, scores.topk(3, dim=-1).indices)
    expect = scores.gather(1, ids)
    if renormalize:
        expect = expect / expect.sum(-1, keepdim=True)
    torch.testing.assert_close(w, expect)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct experts per token


def test_schedule_must_match_the_call():
    x, ids, tw, w = _inputs()
    sched = functional.build_schedule(ids, CFG)
    y, _ = functional.forward(x, ids, tw, w, CFG, schedule=sched)
    y_fresh, _ = functional.forward(x, ids, tw, w, CFG)
    assert torch.equal(y, y_fresh)
    with pytest.raises(ValueError, match="built from another topk_ids tensor"):
        functional.forward(x, ids.clone(), tw, w, CFG, schedule=sched)
    with pytest.raises(ValueError, match="schedule was built for config"):
        cfg2 = CFG.replace(comm_programs=5)
        functional.forward(x, ids, tw, w, cfg2, schedule=functional.build_schedule(ids, CFG))
    with pytest.raises(
        TypeError, match="schedule must come from megamoe.functional.build_schedule"
    ):
        functional.forward(x, ids, tw, w, CFG, schedule=sched.inner)
    ids2 = ids.clone()
    sched2 = functional.build_schedule(ids2, CFG)
    ids2[0] = ids2[0].flip(0)  # modified after the schedule was built
    with pytest.raises(ValueError, match="or the tensor was modified since"):
        functional.forward(x, ids2, tw, w, CFG, schedule=sched2)


def test_grad_y_is_checked():
    x, ids, tw, w = _inputs()
    _, ctx = functional.forward(x, ids, tw, w, CFG)
    with pytest.raises(
        ValueError, match=r"grad_y must have the shape of y \[8, 64\], got \[8, 72\]"
    ):
        functional.backward(ctx, torch.zeros(8, 72))
    with pytest.raises(TypeError, match="grad_y must be a floating tensor, got torch.int64"):
        functional.backward(ctx, torch.zeros(8, 64, dtype=torch.int64))
    with pytest.raises(
        TypeError, match="ctx must be the MoEContext returned by forward, got NoneType"
    ):
        functional.backward(None, torch.zeros(8, 64))


def test_a_retained_graph_runs_its_backward_again():
    """The ops keep their state as saved tensors: with retain_graph a second backward gives the
    same gradients again (they accumulate)."""
    x, ids, tw, w = _inputs()
    x = x.requires_grad_()
    loss = functional.moe(x, ids, tw, w, CFG).float().sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert torch.equal(x.grad, first + first)


def test_unseeded_expert_parallel_ranks_get_different_experts():
    # Two "ranks" with identically seeded global RNGs must not own identical experts.
    class FakeGroup:
        group_name = "fake"

        def __init__(self, rank: int):
            self.rank = rank

    import megamoe.layer as layer_mod

    weights = []
    for rank in (0, 1):
        torch.manual_seed(0)
        orig = layer_mod.group_size_rank
        layer_mod.group_size_rank = lambda g: (2, g.rank)
        try:
            weights.append(MoE(CFG, group=FakeGroup(rank)).w_gate.detach())
        finally:
            layer_mod.group_size_rank = orig
    assert not torch.equal(weights[0], weights[1])
    torch.manual_seed(0)
    full = MoE(CFG).w_gate.detach()  # one process holding all 4 experts, same global seed
    assert torch.equal(torch.cat(weights), full)


def test_auto_falls_back_when_the_kernels_do_not_support_the_call(monkeypatch):
    from megamoe.backends import resolve_backend
    from megamoe.backends import triton as triton_backend

    # Pretend a Hopper GPU is present, so only supports() decides.
    monkeypatch.setattr(triton_backend, "is_available", lambda device=None: (True, "pretend"))
    from megamoe.backends import fused as fused_backend

    monkeypatch.setattr(fused_backend, "is_available", lambda device=None: (True, "pretend"))
    dev = torch.device("cpu")
    good = MoEConfig(128, 64, 4, 2)
    assert resolve_backend("auto", dev, 1, good, torch.bfloat16) == "triton"
    # With expert parallelism the fused forward is measured faster (backends.auto_order).
    assert resolve_backend("auto", dev, 2, good, torch.bfloat16) == "fused"
    assert resolve_backend("auto", dev, 8, good, torch.bfloat16) == "fused"
    assert resolve_backend("auto", dev, 2, good, torch.float32) == "reference"
    assert resolve_backend("auto", dev, 1, good, torch.float32) == "reference"
    assert resolve_backend("auto", dev, 1, MoEConfig(100, 64, 4, 2), torch.bfloat16) == "reference"
    with pytest.raises(RuntimeError, match="hidden_size must be a multiple of 8 .* got 100"):
        resolve_backend("triton", dev, 1, MoEConfig(100, 64, 4, 2), torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be bfloat16 for the Triton kernels"):
        resolve_backend("triton", dev, 1, good, torch.float32)
