"""The custom ops with the Triton backends under the interpreter: a fullgraph compile of router
and MoE gives eager's bits forward and backward, opcheck passes (its fake outputs match the
real ones in shape, dtype and, with PyTorch's deterministic fill, every byte), and the backward
materializes no gradient of the saved state."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megamoe
from megamoe.ops import moe_forward
from support.problems import Case, make_problem

CASE = Case(13, 64, 32, 4, 2, shared=32, block_rows=16)
# (the fused kernel with a ring of every row, and with a bounded ring: no routed state saved;
# fp8, whose saved routed rows are packed fp8 rows)
CONFIGS = {
    "triton": {},
    "triton-fp8": dict(precision="fp8", block_rows=128, minibatch_rows=128),
    "fused": {},
    "fused-ring": dict(minibatch_rows=16, ring_rows=16),
}


def _config(variant: str):
    return CASE.config(**{"minibatch_rows": 16, "ring_rows": None, **CONFIGS[variant]})


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_fullgraph_compile_equals_eager(variant: str) -> None:
    cfg, backend = _config(variant), variant.split("-")[0]
    torch.manual_seed(0)
    router = megamoe.TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k)
    moe = megamoe.MoE(cfg, backend=backend, seed=1)

    def step(x):
        return (moe(x, *router(x)).float() ** 2).sum()

    def grads(fn):
        x = make_problem(CASE, seed=2).x.requires_grad_(True)
        router.zero_grad(set_to_none=True)
        moe.zero_grad(set_to_none=True)
        loss = fn(x)
        loss.backward()
        return [loss.detach(), x.grad, *(p.grad for p in (*router.parameters(), *moe.parameters()))]

    eager = grads(step)
    compiled = grads(torch.compile(step, fullgraph=True, backend="aot_eager"))
    for i, (a, b) in enumerate(zip(compiled, eager)):
        assert torch.equal(a, b), f"output {i}"


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_opcheck(variant: str) -> None:
    cfg, backend = _config(variant), variant.split("-")[0]
    p = make_problem(CASE, seed=3)
    leaf = lambda t: t.clone().requires_grad_(True)  # noqa: E731
    args = (
        leaf(p.x),
        p.topk_ids,
        leaf(p.topk_weights),
        *(leaf(w) for w in p.weights),
        cfg.key,
        "",
        backend,
        False,
    )
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # every byte of every output determined
    try:
        result = torch.library.opcheck(moe_forward, args)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert set(result.values()) == {"SUCCESS"}, result


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _leaves(p):
    x, w = p.x.clone().requires_grad_(True), p.topk_weights.clone().requires_grad_(True)
    weights = type(p.weights)(
        *(None if t is None else t.clone().requires_grad_(True) for t in p.weights)
    )
    return x, w, weights


@pytest.mark.parametrize("path", ["eager", "op"])
def test_backward_materializes_no_gradient_of_the_saved_state(path: str) -> None:
    """The forward op's saved outputs get no gradient: autograd must not zero-fill a tensor of
    each of their shapes for the backward (the size of every saved activation, every step),
    through the eager path (``functional.moe``) or the op's registered autograd (the op called
    directly, as a compiled graph does). Both paths dispatch ``megamoe::moe_forward`` (what
    selective activation checkpointing keys on) and give the same bits."""
    cfg = _config("triton")
    p = make_problem(CASE, seed=4)
    grads = {}
    for run in ("eager", "op"):
        x, w, weights = _leaves(p)
        with _RecordOps() as forward_ops:
            if run == "eager":
                y = megamoe.functional.moe(x, p.topk_ids, w, weights, cfg, backend="triton")
            else:
                args = (x, p.topk_ids, w, *weights, cfg.key, "", "triton", True)
                y = torch.ops.megamoe.moe_forward(*args)[0]
        assert "megamoe.moe_forward.default" in forward_ops.ops, run
        assert len(y.grad_fn.saved_tensors) > 10  # (the schedule and the activations ride along)
        with _RecordOps() as record:
            y.backward(torch.ones_like(y))
        if run == path:
            zeros = [
                o for o in record.ops if o.startswith(("aten.zeros", "aten.zero_", "aten.fill_"))
            ]
            assert not zeros, f"the backward zero-filled {len(zeros)} tensors: {zeros}"
        grads[run] = [x.grad, w.grad, *(t.grad for t in weights if t is not None)]
    for i, (a, b) in enumerate(zip(grads["eager"], grads["op"])):
        assert a is not None and torch.isfinite(a).all(), i
        assert torch.equal(a, b), f"gradient {i}"
