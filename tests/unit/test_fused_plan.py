"""The fused forward's launch plan (``kernels.fused.plan.plan_launch``): computed once per
distinct launch, and again when what it reads changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megamoe.kernels import gemm  # noqa: E402
from megamoe.kernels.fused.plan import plan_launch  # noqa: E402

SIZES = dict(
    rows=1024,
    block_rows=128,
    tokens=256,
    hidden=512,
    intermediate=256,
    shared_intermediate=0,
    top_k=2,
    itemsize=2,
    world_size=1,
    num_comm=None,
    minibatch_rows=256,
    ring_rows=None,
    down_lag=None,
    comm_kernel=True,
    traced=False,
)


def test_the_same_launch_gets_the_same_plan() -> None:
    cpu = torch.device("cpu")
    a = plan_launch(cpu, **SIZES)
    assert plan_launch(cpu, **SIZES) is a
    assert a.meta.as_constexprs() is a.meta.as_constexprs()
    other = plan_launch(cpu, **{**SIZES, "minibatch_rows": 512})
    assert other is not a and other.minibatch_rows == 512


def test_a_plan_follows_the_tiles_it_reads(monkeypatch) -> None:
    """The tiles are not arguments, but a plan made under other tiles is not reused."""
    cpu = torch.device("cpu")
    before = plan_launch(cpu, **SIZES)
    tiles = dict(gemm.INTERPRETER_TILES)
    tiles["mm"] = dataclasses.replace(tiles["mm"], bn=16)
    monkeypatch.setattr(gemm, "INTERPRETER_TILES", tiles)
    after = plan_launch(cpu, **SIZES)
    assert after.meta.BN_DOWN == 16 != before.meta.BN_DOWN


def test_bad_values_still_raise_each_time() -> None:
    for _ in range(2):
        with pytest.raises(ValueError, match="minibatch_rows"):
            plan_launch(torch.device("cpu"), **{**SIZES, "minibatch_rows": 200})
