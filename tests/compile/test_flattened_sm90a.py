"""The flattened tile loops (``GemmTiles.flatten``: one loop over all of a program's K steps)
compile for Hopper (sm_90a) software-pipelined and without spills.

A flattened loop is worth having only if Triton's software pipeliner takes it: then each of a K
step's TMA loads is issued stages - 1 times ahead in the prologue and once in the loop. Triton
3.6 leaves such a loop unpipelined, one load at a time, if a TMA coordinate comes from a
``tl.load`` in the loop or if the epilogue's condition is carried over from the loads' stage;
these tests catch a kernel change (or a Triton) that brings either back. The kernels are the
sweep's flattened candidates (``sweep_tiles.CANDIDATES``) that fit without spills: bf16's weight
gradient in both entries' tiles, fp8's gate/up (2 stages; 3 spill 8 B), forward down and weight
gradient (2 and 3 stages), launched at DeepSeek-V3's expert sizes on meta tensors and compiled
in a subprocess without the interpreter.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from support import background  # noqa: E402
from support.compiled import MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM, SM_SHARED  # noqa: E402

SCRIPT = """
import json, re
from megamoe.kernels import fp8_gemm, gemm
from megamoe.kernels.runtime import assume_programs
from megamoe.tools import sweep_tiles
from megamoe.tools.compile_check import H200_SMS, compile_launch, record_launches

TMA_LOAD = r"cp\\.async\\.bulk\\.tensor\\.\\dd\\.shared::cluster\\.global"
KERNELS = {"_wgrad_kernel": "wgrad", "_fp8_gate_up_kernel": "gate_up",
           "_fp8_grouped_mm_kernel": "mm", "_fp8_wgrad_kernel": "wgrad"}
modules = {"bf16": gemm, "fp8": fp8_gemm}
reports = []
KINDS = (("bf16", ("wgrad", "wgrad_few_rows")), ("fp8", ("gate_up", "mm", "wgrad")))
for precision, kinds in KINDS:
    module = modules[precision]
    for kind in kinds:
        tiles = [t for t in sweep_tiles.CANDIDATES[precision][kind] if t.flatten]
        for t in tiles[-1:] if precision == "fp8" and kind != "wgrad" else tiles:
            if precision == "bf16" and t.warps != module.GPU_TILES[kind].warps:
                continue  # (the other entry's tile)
            with sweep_tiles._tiles(module, kind, t), assume_programs(H200_SMS), \\
                    record_launches(lambda: "dsv3") as launches:
                sweep_tiles._meta_gemms(precision, 7168, 2048, 32, 512, 8)
            for launch in launches:
                if KERNELS.get(launch.name) != kind.split("_few")[0]:
                    continue
                if kind == "mm" and sweep_tiles._row_kind(launch, precision) != "mm":
                    continue
                r = compile_launch(launch, keep_ptx=True)
                r["tma_loads"] = len(re.findall(TMA_LOAD, r.pop("ptx")))
                r.update(precision=precision, kind=kind, stages=t.stages, split_m=t.split_m,
                         per_sm=t.programs_per_sm)
                reports.append(r)
print(json.dumps(reports))
"""

background.define("flattened", ["-c", SCRIPT], timeout=900)


@pytest.fixture(scope="module")
def flattened() -> list[dict]:
    out = background.stdout("flattened")
    return json.loads(out.strip().splitlines()[-1])


def _what(r: dict) -> str:
    return f"{r['precision']} {r['name']} ({r['kind']}, {r['stages']} stages)"


def test_every_flattened_candidate_is_compiled(flattened: list[dict]) -> None:
    got = {(r["precision"], r["kind"]) for r in flattened}
    assert got == {
        ("bf16", "wgrad"),
        ("bf16", "wgrad_few_rows"),
        ("fp8", "gate_up"),
        ("fp8", "mm"),
        ("fp8", "wgrad"),
    }, got


def test_flattened_loops_are_software_pipelined(flattened: list[dict]) -> None:
    for r in flattened:
        # a K step's TMA loads: A (two halves in a split tile) and B (gate/up: two B tiles)
        per_step = (2 if r["split_m"] == 1 else 3) + (r["kind"] == "gate_up")
        assert r["tma_loads"] == per_step * r["stages"], (_what(r), r["tma_loads"])


def test_flattened_loops_fit_without_spills(flattened: list[dict]) -> None:
    for r in flattened:
        threads = r["num_warps"] * 32 * r["per_sm"]
        assert r["registers"] <= MAX_REGISTERS_PER_THREAD, _what(r)
        assert r["registers"] * threads <= REGISTERS_PER_SM, _what(r)
        assert (r["shared"] + 1024) * r["per_sm"] <= SM_SHARED, _what(r)
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, (_what(r), r["spill_bytes"])
