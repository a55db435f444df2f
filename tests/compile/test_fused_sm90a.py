"""The fused kernels lower to real sm_90a code on the CPU and fit one program per SM.

Compiled as the backend launches them at dsv3 sizes on an H200 (``compile_check``'s recorded
launches: 16-byte aligned pointers, the sizes' divisibility, the GPU tiles). Checked: wgmma and
TMA in the GEMM tiles, the release/acquire atomics of the flags, the TMA-store completion and
proxy fences, 16-byte row copies, shared memory <= 227 KB, registers that let one 8-warp program
sit on every SM with no spills, and a comm-kernel program that fits beside it. The fused
backward (W = 1, and rank 0 of W = 2 with its pull and push inside) is recorded here from the
backend's own training step (its own subprocess): the same limits and flags, and one marker per
tile call site (without them the tiles' pipeline buffers were laid side by side: 295 KB).
"""

from __future__ import annotations

import json
import re

import pytest

from megamoe.kernels.fused.plan import COMM_KERNEL_REGISTERS
from megamoe.kernels.fused.residency import SM90_REGISTERS_PER_SM, SM90_SHARED_PER_SM, sm_usage
from support import background
from support.compiled import MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM, SMEM_LIMIT, pick

FP8 = ("fused fp8 dsv3 one kernel", "fused fp8 dsv3 comm kernel")
# a poll of a counter at GPU scope (``comm.wait_flag``'s atomic add of 0: an acquire load)
ACQUIRE = r"(atom|ld)\.global\.gpu\.acquire\.(add|b32)"
UNTRACED = (
    "fused dsv3 comm kernel",
    "fused dsv3 one kernel",
    "fused dsv3 one kernel, ring of 4 minibatches",
    *FP8,  # (beside the comm kernel capped: plan.FP8_FUSED_REGISTERS)
)


def _compute(compiled, scenario: str) -> dict:
    return next(r for r in pick(compiled, "fused_forward_kernel") if r["scenario"] == scenario)


def test_every_untraced_variant_fits_one_program_per_sm_without_spills(compiled) -> None:
    for scenario in UNTRACED:
        r = _compute(compiled, scenario)
        assert ".target sm_90a" in r["ptx"] and r["wgmma"] and r["tma"], scenario
        assert 0 < r["shared"] <= SMEM_LIMIT, f"{scenario}: {r['shared']} B of shared memory"
        threads = r["num_warps"] * 32
        assert r["registers"] <= MAX_REGISTERS_PER_THREAD, scenario
        assert r["registers"] * threads <= REGISTERS_PER_SM, scenario
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, (scenario, r["spill_bytes"])
        assert not r["launcher_error"], (scenario, r["launcher_error"])


def test_flags_use_release_and_acquire(compiled) -> None:
    for scenario in UNTRACED:
        ptx = _compute(compiled, scenario)["ptx"]
        assert re.search(r"atom\.global\.gpu\.release\.add", ptx), "counters must be released"
        # set by this GPU's programs: acquire at GPU scope (a poll, add 0, compiles to an
        # acquire load), nothing at system scope
        assert re.search(ACQUIRE, ptx), "waits must acquire"
        assert not re.search(r"atom\.global\.sys\.", ptx), "no system-scope atomics"
        assert re.search(r"atom\.global\.gpu\.relaxed\.add", ptx), "the task ticket"
        # TMA stores complete (not just read their source) before a release; proxy fences order
        # the async-proxy TMA traffic against the generic-proxy flags and row copies.
        assert "cp.async.bulk.wait_group 0;" in ptx
        assert "fence.proxy.async.global" in ptx


def test_fp8_variants_run_e4m3_wgmma_and_quantize_h(compiled) -> None:
    """In fp8 the tiles are block-scaled e4m3 wgmma from shared memory (both operands K-major)
    and the h tasks round with the saturating e4m3 conversion."""
    for scenario in FP8:
        r = _compute(compiled, scenario)
        assert r["num_warps"] == 8, scenario  # (two warpgroups: 64 rows each)
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", r["ptx"])
        assert "cvt.rn.satfinite.e4m3x2.f32" in r["ptx"], scenario


def test_row_copies_use_16_byte_vectors(compiled) -> None:
    for ptx in (
        _compute(compiled, "fused dsv3 one kernel")["ptx"],
        _compute(compiled, "fused fp8 dsv3 one kernel")["ptx"],  # packed fp8 rows
        pick(compiled, "fused_comm_kernel", "fused dsv3 comm kernel")[0]["ptx"],
        pick(compiled, "fused_comm_kernel", "fused fp8 dsv3 comm kernel")[0]["ptx"],
    ):
        assert re.search(r"ld\.global(\.[a-z0-9]+)*\.v4\.b32", ptx)
        assert re.search(r"st\.global(\.[a-z0-9]+)*\.v4\.b32", ptx)


def test_traced_variants_read_the_global_timer_the_plain_ones_not(compiled) -> None:
    for scenario in UNTRACED:
        assert "%globaltimer" not in _compute(compiled, scenario)["ptx"]
    for scenario in ("fused dsv3 comm kernel traced", "fused dsv3 one kernel traced"):
        r = _compute(compiled, scenario)
        assert "%globaltimer" in r["ptx"] and 0 < r["shared"] <= SMEM_LIMIT
        assert r["registers"] <= MAX_REGISTERS_PER_THREAD


def test_comm_kernel_fits_beside_the_compute_kernel(compiled) -> None:
    """config.comm_kernel: a comm program must fit on every SM next to a compute program, or the
    two kernels cannot run at once (each waits for the other: the start-up count reports it).
    At a row width that is not a multiple of the copy tile the comm kernel would take 159
    registers uncapped (the pair did not run side by side on an H200); the cap keeps it at 80.
    The traced compute kernel needs a few more registers: the pair must still fit."""
    pairs = [
        ("fused dsv3 comm kernel", "fused dsv3 comm kernel"),
        ("fused dsv3 odd row width", "fused dsv3 odd row width"),
        ("fused dsv3 comm kernel traced", "fused dsv3 comm kernel"),
        ("fused fp8 dsv3 comm kernel", "fused fp8 dsv3 comm kernel"),
    ]
    for compute_scenario, comm_scenario in pairs:
        compute = _compute(compiled, compute_scenario)
        (comm,) = pick(compiled, "fused_comm_kernel", comm_scenario)
        assert compute["spill_bytes"] == 0 and compute["stack_bytes"] == 0, compute_scenario
        if comm_scenario == "fused dsv3 comm kernel":  # at dsv3 the cap costs nothing
            assert comm["spill_bytes"] == 0, comm
        assert comm["registers"] <= COMM_KERNEL_REGISTERS
        regs, smem = sm_usage(
            [
                (compute["registers"], compute["num_warps"], compute["shared"]),
                (comm["registers"], comm["num_warps"], comm["shared"]),
            ]
        )
        assert regs <= SM90_REGISTERS_PER_SM, f"{compute_scenario}: {regs} registers per SM"
        assert smem <= SM90_SHARED_PER_SM, f"{compute_scenario}: {smem} B shared memory per SM"


# ------------------------------------------------------------------------------ fused backward

# Records the fused backward's launches of backend "fused"'s training step at W = 1 (dsv3 with
# and without its shared expert, an odd shape, and dsv3 after a bounded ring: one launch per
# macrobatch, the first with the shared expert) and rank 0's at W = 2 (dsv3: the exchange
# inside the kernel; and after a bounded ring), and compiles them (as compile_check does).
_BACKWARD_LAUNCHES = """
import json, os
from megamoe.backends import fused, steps
from megamoe.ep.checks import CHECK_ENV
from megamoe.ep.workspace import emulated_workspaces
from megamoe.kernels.runtime import assume_programs
from megamoe.shapes import get_preset
from megamoe.tools.compile_check import (
    H200_SMS, _problem, compile_launch, record_launches,
)

os.environ[CHECK_ENV] = "off"
os.environ[fused.FUSED_BACKWARD_ENV] = "1"  # (opt-in)
dsv3 = get_preset("dsv3").config(1)
scenarios = {
    "dsv3": dsv3,
    "dsv3 no shared expert": dsv3.replace(shared_intermediate_size=0),
    "odd shape": dsv3.replace(
        hidden_size=520, intermediate_size=200, shared_intermediate_size=200
    ),
}
label = ["?"]
launch = fused.fused_backward


def macrobatch(*args, **kwargs):  # (the first macrobatch has the shared expert, the others not)
    mb = kwargs.get("macrobatch")
    if mb is not None:
        later = "later" if mb.first_row else "first"
        label[0] = f"dsv3 ring, {later} macrobatch"
    return launch(*args, **kwargs)


fused.fused_backward = macrobatch
scenarios["dsv3 ring"] = dsv3.replace(ring_rows=4 * dsv3.minibatch_rows)
with assume_programs(H200_SMS), record_launches(lambda: label[0]) as launches:
    for name, cfg in scenarios.items():
        label[0] = name
        x, ids, w, weights = _problem(cfg, 512)
        sched = fused.build_schedule(ids, cfg, None)
        _, ctx = fused.forward(x, ids, w, weights, cfg, None, sched)
        fused.backward(ctx, x)
    label[0] = "dsv3 W=2 (rank 0)"
    cfg = get_preset("dsv3").config(2)
    ws = emulated_workspaces(2, 512, cfg.hidden_size, cfg.top_k, device="meta")[0]
    x, ids, w, weights = _problem(cfg, 512, 2)
    sched = steps.run_steps(steps.schedule_steps(ids, cfg, ws), ws)
    _, ctx = steps.run_steps(steps.forward_steps(x, w, weights, sched), ws)
    steps.run_steps(fused.backward_steps(ctx, x), ws)
    ep_launch = fused.fused_backward_ep

    def ep_macrobatch(*args, **kwargs):
        later = "later" if kwargs["macrobatch"].first_row else "first"
        label[0] = f"dsv3 W=2 (rank 0) ring, {later} macrobatch"
        return ep_launch(*args, **kwargs)

    fused.fused_backward_ep = ep_macrobatch
    ring = cfg.replace(ring_rows=4 * cfg.minibatch_rows)
    sched = steps.run_steps(steps.schedule_steps(ids, ring, ws), ws)
    _, ctx = steps.run_steps(fused.forward_steps(x, w, weights, sched), ws)
    steps.run_steps(fused.backward_steps(ctx, x), ws)
reports = [
    compile_launch(launch, keep_ptx=True)
    for launch in launches
    if launch.name == "fused_backward_kernel"
]
print(json.dumps(reports))
"""
BACKWARD_SCENARIOS = (
    "dsv3",
    "dsv3 no shared expert",
    "odd shape",
    "dsv3 W=2 (rank 0)",
    "dsv3 ring, first macrobatch",  # after a bounded ring: the carries (C.CARRY)
    "dsv3 ring, later macrobatch",
    "dsv3 W=2 (rank 0) ring, first macrobatch",
    "dsv3 W=2 (rank 0) ring, later macrobatch",
)
# One marker per tile call site (backward.call_site): routed and shared, five tiles each.
CALL_SITES = [
    f"// fused backward: {part} {tile}"
    for part in ("routed", "shared")
    for tile in ("SwiGLU backward", "gate+up dgrad", "d_W_gate", "d_W_up", "d_W_down")
]


# (started at collection's end, after compile_check: it finds dsv3's kernels in Triton's cache)
background.define("backward_compiled", ["-c", _BACKWARD_LAUNCHES], timeout=600)


@pytest.fixture(scope="module")
def backward_compiled() -> dict[str, dict]:
    """The fused backward kernel's compile report per scenario (with its PTX)."""
    out = background.stdout("backward_compiled")
    reports = json.loads(out.strip().splitlines()[-1])
    return {r["scenario"]: r for r in reports}


def test_backward_fits_one_program_per_sm_without_spills(backward_compiled) -> None:
    assert sorted(backward_compiled) == sorted(BACKWARD_SCENARIOS)
    for scenario, r in backward_compiled.items():
        assert ".target sm_90a" in r["ptx"] and r["wgmma"] and r["tma"], scenario
        assert 0 < r["shared"] <= SMEM_LIMIT, f"{scenario}: {r['shared']} B of shared memory"
        assert not r["ptx_local"], f"{scenario}: local memory in the PTX"
        assert r["num_warps"] == 8, scenario  # the unfused GEMMs' warps (the wgmma shapes)
        assert r["registers"] <= MAX_REGISTERS_PER_THREAD, scenario
        assert r["registers"] * r["num_warps"] * 32 <= REGISTERS_PER_SM, scenario
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, (scenario, r["spill_bytes"])


def test_backward_flags_use_release_and_acquire(backward_compiled) -> None:
    for scenario, r in backward_compiled.items():
        ptx = r["ptx"]
        assert re.search(r"atom\.global\.gpu\.release\.add", ptx), scenario
        assert re.search(ACQUIRE, ptx), scenario
        assert re.search(r"atom\.global\.gpu\.relaxed\.add", ptx), "the task ticket"
        assert not re.search(r"atom\.global\.sys\.", ptx), "no system-scope atomics"
        assert "cp.async.bulk.wait_group 0;" in ptx and "fence.proxy.async.global" in ptx


def test_backward_keeps_every_tile_call_site_apart(backward_compiled) -> None:
    for scenario, r in backward_compiled.items():
        shared = not scenario.endswith(("expert", "later macrobatch"))
        for marker in CALL_SITES if shared else CALL_SITES[:5]:
            assert marker in r["ptx"], (scenario, marker)


def test_backward_exchange_copies_rows_with_16_byte_vectors(backward_compiled) -> None:
    """At W > 1 the kernel's comm roles pull dy rows and push d_x rows with 16-byte vectors."""
    for scenario in ("dsv3 W=2 (rank 0)", "dsv3 W=2 (rank 0) ring, later macrobatch"):
        ptx = backward_compiled[scenario]["ptx"]
        assert re.search(r"ld\.global(\.[a-z0-9]+)*\.v4\.b32", ptx), scenario
        assert re.search(r"st\.global(\.[a-z0-9]+)*\.v4\.b32", ptx), scenario


RELEASE = r"atom\.global\.gpu\.release\.add"
V4_LOAD, V4_STORE = (rf"{op}\.global(\.[a-z0-9]+)*\.v4\.b32" for op in ("ld", "st"))


def test_pipelined_fp8_forward_waits_for_each_row_block(compiled) -> None:
    """The pipelined fp8 forward (on a one-rank workspace and at W = 2): the comm kernel's
    pulls (16-byte row copies, released counters) and the warp-specialized gate/up kernel's
    producer, which acquires each row block's counter, then fences the async proxy before its
    TMA loads of those rows; the down kernel, whose consumers wait for their TMA stores to be
    done, fence them and release a counter, and the comm kernel's pushes, which acquire those
    counters and copy the rows with 16-byte stores. All compile without spills. The other
    gate/up and grouped-GEMM kernels (backend "triton", the shared expert, the backward) wait
    for nothing and count nothing. (A launch compiles once: the push programs, and so the
    down GEMM's SMs, do not depend on W, so at W = 2 the push and down may be the one-rank
    ones.)"""
    scenarios = (
        "fused fp8 dsv3 pipelined, one-rank workspace",
        "fused fp8 dsv3 pipelined W=2 (rank 0)",
    )
    all_pushes, all_down = [], []
    for scenario in scenarios:
        comm = [r for r in pick(compiled, "fused_comm_kernel") if r["scenario"] == scenario]
        pulls = [r for r in comm if re.search(RELEASE, r["ptx"])]  # (the pushes count nothing)
        pushes = [r for r in comm if not re.search(RELEASE, r["ptx"])]
        gate_up = [r for r in pick(compiled, "_ws_gate_up_kernel") if r["scenario"] == scenario]
        mms = [r for r in pick(compiled, "_ws_grouped_mm_kernel") if r["scenario"] == scenario]
        down = [r for r in mms if re.search(RELEASE, r["ptx"])]
        all_pushes += pushes
        all_down += down
        assert len(pulls) == len(gate_up) == 1 and len(pushes) <= 1 and len(down) <= 1, scenario
        assert re.search(V4_LOAD, pulls[0]["ptx"]), scenario
        for push in pushes:
            assert re.search(ACQUIRE, push["ptx"]) and re.search(V4_STORE, push["ptx"])
        assert re.search(ACQUIRE, gate_up[0]["ptx"]), scenario
        assert "fence.proxy.async.global" in gate_up[0]["ptx"]
        for d in down:
            assert re.search(r"cp\.async\.bulk\.wait_group 0;", d["ptx"]), scenario
            assert "fence.proxy.async.global" in d["ptx"]
        for r in (*comm, *gate_up, *down):
            assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, (scenario, r["name"])
            assert 0 < r["shared"] <= SMEM_LIMIT and not r["launcher_error"], r["name"]
            assert not (r in gate_up or r in down) or (r["wgmma"] and r["tma"]), r["name"]
    for r in pick(compiled, "_ws_gate_up_kernel"):
        waits = bool(re.search(ACQUIRE, r["ptx"]))
        assert waits == ("pipelined" in r["scenario"]), r["scenario"]
    counting = {r["scenario"] for r in pick(compiled, "_ws_grouped_mm_kernel")
                if re.search(RELEASE, r["ptx"])}  # fmt: skip
    assert counting and counting <= set(scenarios)
    assert all_pushes and all_down, "no push of z or counting down GEMM compiled"
