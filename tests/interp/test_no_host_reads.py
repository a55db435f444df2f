"""No host read of a device value in a training step (the interpreter's stand-in for the GPU's
CUDA-graph capture test): with ``check_values=False`` megamoe's own code never calls
``Tensor.item``, ``tolist``, ``numpy``, ``cpu`` or a tensor's ``bool`` / ``int`` / ``float``
(each a host-device synchronization on a GPU) in the forward or the backward of the Triton
backends. The interpreter itself reads its tensors on the host: only calls made from megamoe's
modules count, except the lagged check's read of its own host-side snapshot (pinned memory on
a GPU, read once the copy's event says it has landed: no wait)."""

from __future__ import annotations

import sys

import pytest
import torch

import megamoe
from support.problems import Case, make_problem

CASE = Case(13, 64, 32, 4, 2, shared=32, block_rows=16)
VARIANTS = {
    "triton": ("triton", {}),
    "fused": ("fused", dict(minibatch_rows=16, ring_rows=None)),
    "fused-ring": ("fused", dict(minibatch_rows=16, ring_rows=16)),
}
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
# (module, function) of the reads of host-side buffers, never of device values
HOST_BUFFER_READS = {("megamoe.ep.checks", "lagged_check")}


@pytest.fixture
def host_reads(monkeypatch):
    """The (method, caller) of every host read that megamoe's code makes while the test runs."""
    seen: list[tuple[str, str]] = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def guarded(self, *args, _name=name, _real=real, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            ours = module == "megamoe" or module.startswith("megamoe.")
            if ours and (module, caller.f_code.co_name) not in HOST_BUFFER_READS:
                seen.append((_name, f"{module}:{caller.f_lineno}"))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    return seen


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("backward_env", ["0", "1"])
def test_a_training_step_reads_nothing_on_the_host(variant, backward_env, host_reads, monkeypatch):
    backend, tunables = VARIANTS[variant]
    monkeypatch.setenv("MEGAMOE_FUSED_BACKWARD", backward_env)
    cfg = CASE.config(**tunables)
    p = make_problem(CASE, seed=4)
    x = p.x.clone().requires_grad_(True)
    w = p.topk_weights.clone().requires_grad_(True)
    weights = megamoe.ExpertWeights(*(t.clone().requires_grad_(True) for t in p.weights))
    host_reads.clear()
    y = megamoe.functional.moe(x, p.topk_ids, w, weights, cfg, backend=backend, check_values=False)
    (y.float() * p.grad_y.float()).sum().backward()
    assert not host_reads, f"host reads in megamoe's code: {host_reads}"
    assert x.grad is not None and w.grad is not None


def test_the_guard_sees_a_host_read(host_reads):
    """The guard works: a value check (check_values=True reads the ids on the host) is seen."""
    cfg = CASE.config()
    p = make_problem(CASE, seed=5)
    megamoe.functional.moe(p.x, p.topk_ids, p.topk_weights, megamoe.ExpertWeights(*p.weights), cfg)
    assert host_reads
