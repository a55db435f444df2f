"""Every kernel compiles for Hopper (sm_90a) on the CPU: wgmma + TMA in the GEMMs, smem fits.

Compilation runs in a subprocess with the interpreter switched off (``@triton.jit`` functions
defined under ``TRITON_INTERPRET=1`` cannot be compiled). No GPU is needed: Triton ships ptxas.
"""

from __future__ import annotations

import json

import pytest

from helpers import run_without_interpreter

pytest.importorskip("triton")

SMEM_LIMIT = 227 * 1024
EXPECTED = {"histogram", "scan", "place", "gather", "route_grad", "combine", "combine_slots",
            "capacity", "gate_up", "down", "dgrad_swiglu", "dgrad_pair", "wgrad"}


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    out = run_without_interpreter(["-m", "megamoe.kernels.compile_check", "--json"], timeout=600)
    return {r["name"]: r for r in json.loads(out.strip().splitlines()[-1])}


def test_every_kernel_is_compiled(compiled: dict[str, dict]) -> None:
    assert set(compiled) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_targets_sm90a_and_fits_shared_memory(compiled: dict[str, dict], name: str) -> None:
    r = compiled[name]
    assert r["target_sm90a"], f"{name}: PTX is not for sm_90a"
    assert 0 <= r["shared"] <= SMEM_LIMIT, f"{name}: {r['shared']} B of shared memory > 227 KB"
    assert not r["spills"], f"{name}: uses local memory (register spills)"


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n in {
    "gate_up", "down", "dgrad_swiglu", "dgrad_pair", "wgrad"}))
def test_gemms_use_wgmma_and_tma(compiled: dict[str, dict], name: str) -> None:
    r = compiled[name]
    assert r["is_gemm"]
    assert r["wgmma"], f"{name}: no wgmma.mma_async in the PTX"
    assert r["tma"], f"{name}: no cp.async.bulk.tensor (TMA) in the PTX"


def test_kernel_globals_equal_themselves() -> None:
    """Triton's launcher compares each global a kernel read with its value at compile time and
    raises when they differ; a NaN constexpr never equals itself, so every launch after the first
    failed on GPUs (never under the interpreter)."""
    import importlib
    import pkgutil

    import triton.language as tl

    import megamoe.kernels as kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"megamoe.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, tl.constexpr):
                assert value.value == value.value, f"{info.name}.{name} = {value.value!r}"
