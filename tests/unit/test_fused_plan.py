"""The fused forward's launch plan (``kernels.fused.plan.plan_launch``): computed once per
distinct launch, and again when what it reads changes; the pipelined fp8 forward's pulls
(``plan_pulls``)."""

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


def test_pull_programs_keep_pace_with_the_warp_specialized_gate_up() -> None:
    """The pipelined fp8 forward's pull programs on 132 SMs (docs/tuning.md): a narrower
    expert (fewer gate/up FLOPs a pulled byte) and NVLink's slower pulls (W > 1) need more;
    never the whole grid. ``plan_pulls`` leaves the other SMs to the GEMMs, pulls with the
    comm kernel's pull phase only, and names a count that leaves them none."""
    from megamoe.kernels import fp8
    from megamoe.kernels.fused.plan import COMM_PULL, plan_pulls, pull_programs_for
    from megamoe.kernels.runtime import persistent_programs

    def pulls(h: int, i: int, w: int, programs: int = 132) -> int:
        return pull_programs_for(programs, h, i, 2 * fp8.packed_width(h), w)

    assert [pulls(7168, 2048, 1), pulls(2048, 768, 1)] == [8, 19]  # dsv3, qwen3-30b
    assert [pulls(7168, 2048, 2), pulls(2048, 768, 2)] == [12, 27]
    assert pulls(2048, 16, 2, programs=4) == 3 and pulls(7168, 4096, 1, programs=2) == 1
    cpu = torch.device("cpu")
    pulled = ("rows", "block_rows", "tokens", "hidden", "intermediate", "top_k", "world_size")
    sizes = {name: SIZES[name] for name in (*pulled, "minibatch_rows")}
    sizes["row_words"] = fp8.packed_width(SIZES["hidden"])
    plan = plan_pulls(cpu, num_comm=None, **sizes)
    assert plan.programs + plan.num_comm == persistent_programs(cpu) and plan.programs >= 1
    assert plan.meta.PHASE == COMM_PULL and plan.meta.NUM_COMM == plan.num_comm
    assert plan.max_minibatches == 4 and plan_pulls(cpu, num_comm=None, **sizes) is plan
    with pytest.raises(ValueError, match=r"num_comm \(\d+\) comm programs must leave SMs"):
        plan_pulls(cpu, num_comm=persistent_programs(cpu), **sizes)
