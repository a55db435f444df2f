"""The float64 oracle and the tolerance check of the bf16 kernels."""

from __future__ import annotations

import torch

from megamoe.reference import moe_reference
from megamoe.tools.testing import rel_err
from megamoe.types import ExpertWeights, MoEGrads

from .problems import Problem

__all__ = ["loop_oracle", "reference_grads", "compare", "run_backend", "GRAD_NAMES", "rel_err"]

GRAD_NAMES = MoEGrads._fields


def loop_oracle(
    x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, weights: ExpertWeights
) -> torch.Tensor:
    """The layer's definition token by token, in float64; independent of megamoe.reference."""
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    wg, wu, wd, sg, su, sd = (f64(t) for t in weights)
    xd = x.double()
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g, u = wg[e] @ xd[t], wu[e] @ xd[t]
            acc = acc + tw[t, k].double() * (wd[e] @ (g * torch.sigmoid(g) * u))
        if sg is not None:
            g, u = sg @ xd[t], su @ xd[t]
            acc = acc + sd @ (g * torch.sigmoid(g) * u)
        out.append(acc)
    return torch.stack(out)


def reference_grads(p: Problem, dtype: torch.dtype) -> tuple[torch.Tensor, MoEGrads]:
    """y and all gradients of the one-process reference layer computed in ``dtype`` (float64:
    the oracle)."""
    present = [p.x, p.topk_weights] + [w for w in p.weights if w is not None]
    # The router weights stay fp32 in the bf16 reference, as the layer's contract has them.
    leaves = [
        t.detach()
        .to(dtype if dtype == torch.float64 or j != 1 else torch.float32)
        .requires_grad_(True)
        for j, t in enumerate(present)
    ]
    weights = ExpertWeights(*leaves[2:], *([None] * (8 - len(leaves))))
    with torch.enable_grad():
        y = moe_reference(leaves[0], p.topk_ids, leaves[1], weights, p.config)
        grads = torch.autograd.grad(y, leaves, p.grad_y.to(dtype))
    grads = list(grads) + [None] * (8 - len(grads))
    return y.detach(), MoEGrads(*grads)


def compare(
    ours: tuple[torch.Tensor, MoEGrads],
    oracle: tuple[torch.Tensor, MoEGrads],
    bf16_ref: tuple[torch.Tensor, MoEGrads],
    slack: float = 1e-3,
) -> dict[str, float]:
    """Assert every output is finite, has the reference's shape/dtype class and is at most
    ``2 * err(bf16 reference) + slack`` away from the oracle; return the errors."""
    errors = {}
    names = ("y",) + GRAD_NAMES
    for name, a, o, b in zip(
        names, (ours[0], *ours[1]), (oracle[0], *oracle[1]), (bf16_ref[0], *bf16_ref[1])
    ):
        if o is None:
            assert a is None, f"{name}: expected None"
            continue
        assert a.shape == o.shape, f"{name}: shape {tuple(a.shape)} != {tuple(o.shape)}"
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != reference {b.dtype}"
        assert torch.isfinite(a).all(), f"{name}: non-finite values (unwritten or leaked padding)"
        err, bound = rel_err(a, o), 2 * rel_err(b, o) + slack
        errors[name] = err
        assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.3e}"
    return errors


def run_backend(p: Problem, backend_name: str = "triton") -> tuple[torch.Tensor, MoEGrads]:
    """Schedule, forward and backward of a Triton backend with every buffer poisoned."""
    import importlib

    from megamoe.kernels.runtime import poisoned_buffers

    backend = importlib.import_module(f"megamoe.backends.{backend_name}")
    with poisoned_buffers():
        sched = backend.build_schedule(p.topk_ids, p.config, None)
        y, ctx = backend.forward(p.x, p.topk_ids, p.topk_weights, p.weights, p.config, None, sched)
        grads = backend.backward(ctx, p.grad_y)
    return y, grads
