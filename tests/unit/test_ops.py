"""The layer's custom ops (backend "reference" on the CPU): torch.compile traces a block of router
and MoE with fullgraph and no graph break and gives eager's bits, forward and backward;
opcheck passes; what the ops refuse (second-order gradients, torch.func transforms) says so."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megamoe
from megamoe.ops import moe_forward
from support.problems import Case, make_problem
from support.procs import run_gloo

CASE = Case(13, 64, 32, 4, 2, shared=32, block_rows=16)


def _block(backend: str, world: int = 1, group=None):
    """A router and an MoE layer (the same weights for a seed), and a training step's loss."""
    cfg = CASE._replace(experts=CASE.experts * world).config()
    torch.manual_seed(0)
    router = megamoe.TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k)
    moe = megamoe.MoE(cfg, group=group, backend=backend, seed=1)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = moe(x, *router(x))
        return (y.float() * torch.linspace(-1, 1, y.shape[1])).square().sum()

    return router, moe, step


def _grads(step, x, *modules) -> list[torch.Tensor]:
    """The loss and every gradient of one training step."""
    leaf = x.detach().clone().requires_grad_(True)
    for m in modules:
        m.zero_grad(set_to_none=True)
    loss = step(leaf)
    loss.backward()
    return [loss.detach(), leaf.grad, *(p.grad for m in modules for p in m.parameters())]


def _assert_compiled_equals_eager(backend: str, world: int = 1, group=None, rank: int = 0):
    router, moe, step = _block(backend, world, group)
    x = make_problem(CASE, seed=3 + rank).x
    eager = _grads(step, x, router, moe)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = _grads(compiled, x, router, moe)
    for i, (a, b) in enumerate(zip(got, eager)):
        assert b is not None and torch.equal(a, b), f"output {i} differs from eager"


def test_fullgraph_compile_of_router_and_moe_equals_eager() -> None:
    _assert_compiled_equals_eager("reference")


def test_compiled_step_has_no_graph_break() -> None:
    router, moe, step = _block("reference")
    explained = torch._dynamo.explain(step)(make_problem(CASE, seed=4).x.requires_grad_(True))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _compile_over_ranks(rank: int, world: int) -> None:
    _assert_compiled_equals_eager("reference", world, dist.group.WORLD, rank)


def test_fullgraph_compile_over_two_gloo_ranks_equals_eager() -> None:
    run_gloo(2, _compile_over_ranks)


def _op_args(backend: str, requires_grad: bool = True) -> tuple:
    p = make_problem(CASE, seed=5)
    leaf = lambda t: t.clone().requires_grad_(requires_grad)  # noqa: E731
    return (
        leaf(p.x),
        p.topk_ids,
        leaf(p.topk_weights),
        *(leaf(w) for w in p.weights),
        p.config.key,
        "",
        backend,
        False,
    )


def test_opcheck() -> None:
    result = torch.library.opcheck(moe_forward, _op_args("reference"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_second_order_gradients_are_refused() -> None:
    router, moe, step = _block("reference")
    x = make_problem(CASE, seed=6).x.requires_grad_(True)
    (grad,) = torch.autograd.grad(step(x), x, create_graph=False)
    assert torch.isfinite(grad.float()).all()
    with pytest.raises(RuntimeError, match="second-order gradients .* are not supported"):
        torch.autograd.grad(step(x), x, create_graph=True)


def test_torch_func_transforms_are_refused() -> None:
    router, moe, step = _block("reference")
    x = make_problem(CASE, seed=7).x
    with pytest.raises(RuntimeError, match="does not support torch.func transforms"):
        torch.func.grad(step)(x)
    with pytest.raises(RuntimeError, match="does not support torch.func transforms"):
        torch.func.vjp(step, x)


class _Watching(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that lets every op through (as selective checkpointing's policy does)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Subclass(torch.Tensor):
    """A tensor subclass (its ops go through ``__torch_function__``)."""


@pytest.mark.parametrize("watch", ["none", "dispatch_mode", "profiler", "subclass"])
def test_eager_calls_dispatch_the_ops_only_when_watched(watch: str, monkeypatch) -> None:
    """An eager step calls the ops' bodies directly (past the dispatcher's host time), and
    through the dispatcher while a dispatch mode or the profiler watches, or for a tensor
    subclass; the same bits."""
    from megamoe import ops

    calls = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)

        return wrapper

    # (the registered ops hold the original bodies: only direct calls are counted)
    monkeypatch.setattr(ops, "_forward_impl", counted("forward", ops._forward_impl))
    monkeypatch.setattr(ops, "_backward_impl", counted("backward", ops._backward_impl))
    router, moe, step = _block("reference")
    x = make_problem(CASE, seed=8).x
    assert not ops._dispatch_ops()
    if watch == "dispatch_mode":
        with _Watching():
            assert ops._dispatch_ops()
            got = _grads(step, x, router, moe)
    elif watch == "profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert ops._dispatch_ops()
            got = _grads(step, x, router, moe)
        names = {e.key for e in prof.key_averages()}
        assert {"megamoe::moe_forward", "megamoe::moe_backward"} <= names, sorted(names)
    elif watch == "subclass":
        got = _grads(step, x.as_subclass(_Subclass), router, moe)
    else:
        got = _grads(step, x, router, moe)
    direct = watch == "none"
    assert calls == {"forward": int(direct), "backward": int(direct)}, calls
    monkeypatch.undo()
    with _Watching():
        reference = _grads(step, x, router, moe)
    for i, (a, b) in enumerate(zip(got, reference)):
        assert b is not None and torch.equal(a, b), f"output {i}"
