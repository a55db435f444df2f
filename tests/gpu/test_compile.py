"""Backends "triton" and "fused" on one Hopper GPU through the custom ops: a training step of
router + MoE compiled with fullgraph gives eager's bits, captured in a CUDA graph it replays to
them (also on new routing written into the captured inputs), and inductor compiles it too. Also
backend "fused" with its fused backward after a ring of a quarter of the rows (the backward
replays one macrobatch per launch and carries the weight gradients across them).

Run on the device: ``python -m pytest tests/gpu/test_compile.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import megamoe  # noqa: E402
from support.oracle import rel_err  # noqa: E402
from support.problems import Case, make_problem  # noqa: E402

DEV = torch.device("cuda")
# a Qwen3-30B-like layer (one rank's share of the experts), with a shared expert
CASE = Case(2048, 2048, 768, 32, 8, shared=512, block_rows=128)
# name: (backend, ring rows (None: every row), MEGAMOE_FUSED_BACKWARD)
VARIANTS = {
    "triton": ("triton", None, "0"),
    "fused": ("fused", None, "0"),
    "fused backward, ring of 4096 of 16384 rows": ("fused", 4096, "1"),
}


def _block(backend: str, ring_rows: int | None = None):
    cfg = CASE.config(minibatch_rows=1024, ring_rows=ring_rows)
    torch.manual_seed(0)
    router = megamoe.TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, device=DEV)
    moe = megamoe.MoE(cfg, backend=backend, device=DEV, seed=1)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = moe(x, *router(x))
        return (y.float() * torch.linspace(-1, 1, y.shape[1], device=DEV)).square().sum()

    return router, moe, step


def _params(router, moe) -> list[torch.Tensor]:
    return [*router.parameters(), *moe.parameters()]


def _run(step, x, params) -> list[torch.Tensor]:
    """One training step from zero gradients: the loss, d_x and every parameter gradient."""
    for p in params:
        p.grad = None
    x.grad = None
    loss = step(x)
    loss.backward()
    return [loss.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in params)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_compiled_step_and_its_cuda_graph_give_eager_bits(variant: str, monkeypatch) -> None:
    backend, ring_rows, fused_backward = VARIANTS[variant]
    monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", fused_backward)
    router, moe, step = _block(backend, ring_rows)
    params = _params(router, moe)
    x = make_problem(CASE, seed=2, device=DEV).x.requires_grad_(True)
    eager = _run(step, x, params)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for i, (a, b) in enumerate(zip(_run(compiled, x, params), eager)):
        assert torch.equal(a, b), f"compiled output {i} differs from eager"

    static_x = x.detach().clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (and fill the caching allocator) off the capture
        _run(compiled, static_x, params)
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = compiled(static_x)
        loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    replayed = [loss, static_x.grad, *(p.grad for p in params)]
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert torch.equal(a, b), f"replayed output {i} differs from eager"
    moe.check()  # nothing recorded on the device

    # other tokens in the captured input: the graph follows them (routing lives on the device)
    other = make_problem(CASE, seed=3, device=DEV).x
    static_x.data.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    fresh = _run(step, other.clone().requires_grad_(True), params)
    for i, (a, b) in enumerate(zip([loss, static_x.grad, *(p.grad for p in params)], fresh)):
        assert torch.equal(a, b), f"replayed output {i} on new tokens differs from eager"


@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_inductor_compiles_the_step(backend: str) -> None:
    """Inductor generates the router's kernels (other rounding than eager's, which can flip a
    near-tied top-k choice: the loss is close, not bitwise); the MoE op runs the same kernels."""
    router, moe, step = _block(backend)
    params = _params(router, moe)
    x = make_problem(CASE, seed=4, device=DEV).x.requires_grad_(True)
    eager = _run(step, x, params)
    got = _run(torch.compile(step, fullgraph=True), x, params)
    assert rel_err(got[0], eager[0]) < 1e-2, (got[0], eager[0])
    for i, a in enumerate(got):
        assert torch.isfinite(a).all(), f"output {i}"
