"""Host-side helpers shared by the kernel launchers: interpreter detection, grid size, descriptors.

Kept apart from the kernels so that launchers, the backend and the tests agree on one answer to
"are we interpreting?" and "how many programs make a persistent grid?".
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = [
    "interpreting",
    "cdiv",
    "persistent_programs",
    "launch_grid",
    "launch",
    "assume_programs",
    "compiling_for_hopper",
    "descriptor",
    "empty",
    "check_out",
    "poisoned_buffers",
    "side_stream",
    "INTERPRETER_PROGRAMS",
]

# Under the interpreter programs run one after another: a few programs are enough to exercise
# the persistent loops (every program takes several tiles) while keeping CPU tests fast.
INTERPRETER_PROGRAMS = 3


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1), as Triton reads
    it (its knob: a fifth of ``os.environ.get``'s host time, called dozens of times a step)."""
    return knobs.runtime.interpret


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, queried once per GPU (each query reads the
    device's properties: microseconds, several times a step)."""
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' sizes: ``triton.cdiv`` is a constexpr function in Triton
    3.6, whose host calls cost microseconds each (a hundred a training step)."""
    return -(-a // b)


# Set by assume_programs: the SM count of a GPU that is not here (the compile check).
_ASSUMED_PROGRAMS: int | None = None


@contextlib.contextmanager
def assume_programs(programs: int) -> Iterator[None]:
    """Within this block, launchers on a device without CUDA (meta tensors, not the interpreter)
    size their grids for a GPU of ``programs`` SMs: ``megamoe.tools.compile_check`` records the
    launches of an H200 this way on any machine."""
    global _ASSUMED_PROGRAMS
    old, _ASSUMED_PROGRAMS = _ASSUMED_PROGRAMS, programs
    try:
        yield
    finally:
        _ASSUMED_PROGRAMS = old


def compiling_for_hopper() -> bool:
    """True inside :func:`assume_programs` outside the interpreter: launches are recorded for
    an sm_90a compile (``megamoe.tools.compile_check``), so Hopper-only kernels are chosen."""
    return _ASSUMED_PROGRAMS is not None and not interpreting()


def persistent_programs(device: torch.device) -> int:
    """One program per SM on a GPU (the persistent grid); a handful in the interpreter."""
    if interpreting() or device.type != "cuda":
        if _ASSUMED_PROGRAMS is not None and not interpreting():
            return _ASSUMED_PROGRAMS
        return INTERPRETER_PROGRAMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def launch_grid(
    work_items: int, device: torch.device, programs: int | None = None, per_sm: int = 1
) -> tuple[int]:
    """A persistent grid: ``per_sm`` programs on each SM, or on each of ``programs`` SMs (e.g.
    the SMs the NVLink copies leave free); never more programs than there are tiles."""
    sms = persistent_programs(device) if programs is None else programs
    if sms < 1:
        raise ValueError(f"programs must be >= 1, got {sms}")
    return (max(1, min(sms * per_sm, work_items)),)


# 0 turns direct launches off (read at import): every launch then takes Triton's path.
DIRECT_LAUNCH_ENV = "MEGAMOE_DIRECT_LAUNCH"
_DIRECT = os.environ.get(DIRECT_LAUNCH_ENV, "1") != "0"
# Triton's launch path as imported: a tool that patches it (the compile check's recorder, the
# host profile's timers, the launch probe) sees every launch through it.
_JIT_RUN = JITFunction.run
# (kernel, device) -> Triton's argument binder, for kernels that have launched on that GPU
_BINDERS: dict[tuple, object] = {}
# (kernel, device, specialization, options, debug, instrumentation mode) -> the kernel Triton
# compiled for them
_COMPILED: dict[tuple, CompiledKernel] = {}


def _no_launch_hooks() -> bool:
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return all(h is None or (type(h).__name__ == "HookChain" and not h.calls) for h in hooks)


def _compiled_key(kernel, device: int, spec: list, opts: dict) -> tuple:
    return (
        kernel, device, tuple(spec), tuple(opts.items()), knobs.runtime.debug,
        knobs.compilation.instrumentation_mode,
    )  # fmt: skip


def _find_compiled(key: tuple) -> CompiledKernel | None:
    try:
        return _COMPILED.get(key)
    except TypeError:  # a value that cannot be hashed: such launches keep Triton's path
        return None


def launch(kernel, grid: tuple[int, ...], *args, **options) -> None:
    """``kernel[grid](*args, **options)``. Once the kernel has run on this GPU, the kernel
    compiled for these arguments' specialization (found with Triton's own binder) is launched
    directly, past the rest of Triton's per-launch work (docs/design.md, "Layers of the
    package"; ``MEGAMOE_DIRECT_LAUNCH=0`` turns this off). The interpreter, launch hooks, a
    kernel's pre-run hooks, a specialization that cannot be hashed and tools that patch
    ``JITFunction.run`` take Triton's path."""
    if (
        not _DIRECT
        or interpreting()
        or JITFunction.run is not _JIT_RUN
        or not _no_launch_hooks()
        or kernel.pre_run_hooks
    ):
        kernel[grid](*args, **options)
        return
    device = torch.cuda.current_device()
    binder = _BINDERS.get((kernel, device))
    if binder is not None:
        bound, spec, opts = binder(*args, **options)
        compiled = _find_compiled(_compiled_key(kernel, device, spec, opts))
        if compiled is not None:
            g0, g1, g2 = (*grid, 1, 1)[:3]
            stream = torch._C._cuda_getCurrentRawStream(device)  # (as Triton's driver reads it)
            compiled.run(
                g0, g1, g2, stream, compiled.function, compiled.packed_metadata,
                None, None, None, *bound.values(),
            )  # fmt: skip
            return
    compiled = kernel[grid](*args, **options)
    if isinstance(compiled, CompiledKernel):  # (else a recorded or interpreted launch)
        binder = _BINDERS.setdefault((kernel, device), kernel.device_caches[device][4])
        _, spec, opts = binder(*args, **options)
        try:
            _COMPILED[_compiled_key(kernel, device, spec, opts)] = compiled
        except TypeError:  # (not hashable: see _find_compiled)
            pass


@functools.lru_cache(maxsize=None)
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one second stream per device: work beside the copies, the fused comm kernel."""
    return torch.cuda.Stream(device)


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA tensor descriptor over ``t`` (out-of-bounds loads read zeros, stores are clipped)."""
    return TensorDescriptor.from_tensor(t, block)


# Test hook: when set, every buffer the launchers allocate starts as NaN (floats) or a huge
# sentinel (ints), so an element a kernel forgot to write shows up in the results.
_POISON = False
_INT_POISON = -(2**30)
# Ints too narrow for it (int16 packed fp8 rows, bytes): every byte 0x7F, a large integer
# that reads as NaN in float8_e4m3fn and as 3.4e38 in a float32 scale.
_BYTE_POISON = 0x7F


@contextlib.contextmanager
def poisoned_buffers() -> Iterator[None]:
    """Within this block, kernel outputs and workspaces are allocated pre-filled with poison."""
    global _POISON
    old, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = old


def empty(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs: poisoned under :func:`poisoned_buffers`, zeros when
    PyTorch fills uninitialized memory (``torch.use_deterministic_algorithms(True)``, whose
    ``fill_uninitialized_memory`` is on by default: every byte of every output is then
    determined, also the rows past a schedule's used ones that no kernel writes)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not _POISON:
        if (
            torch.are_deterministic_algorithms_enabled()
            and torch.utils.deterministic.fill_uninitialized_memory
        ):
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, _poison(dtype), dtype=dtype, device=device)


def check_out(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """An output buffer a caller passed to a launcher: ``t`` itself when it is a contiguous
    ``dtype`` tensor of ``shape``, else a ValueError naming ``name``, what it got and what was
    expected."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} {list(shape)} tensor, got {t.dtype} "
            f"{list(t.shape)} strides {t.stride()}"
        )
    return t


def _poison(dtype: torch.dtype) -> float | int | bool:
    """The fill of a poisoned buffer of ``dtype`` (it must fit the dtype)."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    info = torch.iinfo(dtype)
    if info.min <= _INT_POISON <= info.max:
        return _INT_POISON
    return int.from_bytes(bytes([_BYTE_POISON]) * (info.bits // 8), "little")
