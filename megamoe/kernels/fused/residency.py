"""Two kernels side by side on every SM (the comm kernel beside the compute kernel).

Their programs wait on each other, so every program of both must be resident at once. That
holds only if a compute and a comm program fit on one SM together (registers, shared memory:
:func:`sm_usage`, :func:`check_side_by_side`) and both kernels run with the same, largest
shared-memory carveout (:func:`prefer_shared`).
"""

from __future__ import annotations

import ctypes

__all__ = [
    "sm_usage",
    "check_side_by_side",
    "prefer_shared",
    "SM90_REGISTERS_PER_SM",
    "SM90_SHARED_PER_SM",
]

# Per-SM limits of sm_90 that a compute and a comm program must share (CUDA occupancy rules):
# registers are given per warp in units of 256, and each program reserves 1 KB of shared memory.
SM90_REGISTERS_PER_SM = 64 * 1024
SM90_REGISTER_UNIT = 256
SM90_SHARED_PER_SM = 228 * 1024
SM90_SHARED_RESERVED_PER_PROGRAM = 1024
_CU_FUNC_CACHE_PREFER_SHARED = 1
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
_CARVEOUT_ALL_SHARED = 100  # percent of the SM's L1 / shared memory that is shared memory
_PREFERRED: set[int] = set()


def sm_usage(programs: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(registers, shared memory bytes) that programs given as (registers per thread, warps,
    shared bytes) hold together on one sm_90 SM."""
    regs = sum(-(-r * 32 // SM90_REGISTER_UNIT) * SM90_REGISTER_UNIT * w for r, w, _ in programs)
    return regs, sum(b + SM90_SHARED_RESERVED_PER_PROGRAM for _, _, b in programs)


def check_side_by_side(compute, comm_kernel) -> None:
    """Refuse a pair of compiled kernels whose programs cannot share an SM: the compute kernel's
    programs would wait at the start-up count for comm programs the GPU never places."""
    pair = [(k.n_regs, k.metadata.num_warps, k.metadata.shared) for k in (compute, comm_kernel)]
    regs, smem = sm_usage(pair)
    if regs > SM90_REGISTERS_PER_SM or smem > SM90_SHARED_PER_SM:
        raise RuntimeError(
            f"comm_kernel: a compute program and a comm program (registers per thread, warps, "
            f"shared bytes: {pair[0]} and {pair[1]}) need {regs} registers and {smem} B of "
            f"shared memory per SM, more than the {SM90_REGISTERS_PER_SM} and "
            f"{SM90_SHARED_PER_SM} B an SM has: run with config.comm_kernel=False"
        )


def prefer_shared(kernel):
    """Load a compiled ``kernel`` and ask the driver for the largest shared-memory carveout for
    it (once per loaded function): the compute and the comm kernel share SMs only if both run
    with the same one."""
    kernel._init_handles()
    if kernel.function in _PREFERRED:
        return kernel
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = ctypes.c_void_p(kernel.function)
    for what, err in (
        ("cache config", cuda.cuFuncSetCacheConfig(fn, _CU_FUNC_CACHE_PREFER_SHARED)),
        (
            "carveout",
            cuda.cuFuncSetAttribute(
                fn, _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, _CARVEOUT_ALL_SHARED
            ),
        ),
    ):
        if err:
            raise RuntimeError(
                f"setting a comm-kernel launch's shared-memory {what} failed: CUDA error {err}"
            )
    _PREFERRED.add(kernel.function)
    return kernel
