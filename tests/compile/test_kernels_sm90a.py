"""Every kernel the backends launch compiles for Hopper (sm_90a) on the CPU: shared memory fits,
the GEMMs use wgmma and TMA, and registers and spills stay where they are (a regression shows).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from support.compiled import SMEM_LIMIT, pick

GEMMS = ("_gate_up_kernel", "_grouped_mm_kernel", "_wgrad_kernel", "fused_forward_kernel")
# ptxas spill stores (bytes) a kernel may have at most, over its recorded variants; every other
# kernel has none. These are the kernels as they are: a change that spills more fails here.
SPILL_LIMITS = {
    "_scan_kernel": 160,  # the one-program scan of the schedule
    "_grouped_mm_kernel": 68,  # its SwiGLU-backward epilogue (dgrad of down)
    "_pull_tokens_kernel": 140,  # 32 warps, 128 KB copy tiles
    "_pull_kernel": 24,
    "fused_comm_kernel": 120,  # capped at 80 registers; only at a row width off the copy tile
    "fused_forward_kernel": 48,  # only the traced one-kernel variant (a profile may cost that)
    "_combine_kernel": 7000,  # only at a row width not divisible by 16 (H = 520)
}


def _kernel_names() -> set[str]:
    """Every @triton.jit kernel (a function named *kernel) of megamoe.kernels (interpreted
    functions when this process runs the interpreter)."""
    import megamoe.kernels as kernels

    names = set()
    for info in pkgutil.walk_packages(kernels.__path__, "megamoe.kernels."):
        module = importlib.import_module(info.name)
        names |= {
            v.fn.__name__
            for v in vars(module).values()
            if isinstance(v, (JITFunction, InterpretedFunction))
            and v.fn.__name__.endswith("kernel")
        }
    return names


def test_every_kernel_is_launched_and_compiled(compiled: list[dict]) -> None:
    assert {r["name"] for r in compiled} == _kernel_names()


def test_targets_sm90a_and_fits_shared_memory(compiled: list[dict]) -> None:
    for r in compiled:
        what = f"{r['name']} ({r['scenario']})"
        assert r["target_sm90a"], f"{what}: PTX is not for sm_90a"
        assert 0 <= r["shared"] <= SMEM_LIMIT, f"{what}: {r['shared']} B of shared memory"
        assert not r["ptx_local"], f"{what}: local memory in the PTX"
        assert not r["launcher_error"], f"{what}: no host launcher: {r['launcher_error']}"
        assert "multimem" not in r["ptx"] and "multicast" not in r["ptx"], what


@pytest.mark.parametrize("name", GEMMS)
def test_gemms_use_wgmma_and_tma(compiled: list[dict], name: str) -> None:
    for r in pick(compiled, name):
        assert r["wgmma"], f"{name} ({r['scenario']}): no wgmma.mma_async in the PTX"
        assert r["tma"], f"{name} ({r['scenario']}): no cp.async.bulk.tensor (TMA)"


def test_spills_do_not_grow(compiled: list[dict]) -> None:
    for r in compiled:
        limit = SPILL_LIMITS.get(r["name"], 0)
        assert r["spill_bytes"] <= limit, (
            f"{r['name']} ({r['scenario']}): {r['spill_bytes']} B of spill stores > {limit}"
        )


def test_kernel_globals_equal_themselves() -> None:
    """Triton's launcher compares each global a kernel read with its value at compile time and
    raises when they differ; a NaN constexpr never equals itself, so every launch after the first
    failed on GPUs (never under the interpreter)."""
    import triton.language as tl

    import megamoe.kernels as kernels

    for info in pkgutil.walk_packages(kernels.__path__, "megamoe.kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, tl.constexpr):
                assert value.value == value.value, f"{info.name}.{name} = {value.value!r}"
