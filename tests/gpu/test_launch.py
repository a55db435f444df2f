"""The launch path of every kernel (``runtime.launch``) on one GPU with direct launches on (the
default; ``MEGAMOE_DIRECT_LAUNCH=0`` turns them off): after a kernel's first launch the compiled
kernel is found by the arguments' specialization and launched directly; a new specialization
compiles through Triton again, launch hooks, patched launch paths, an unhashable specialization
and the switch off take Triton's path, and a training step gives the same bits either way.

Run on the device: ``python -m pytest tests/gpu/test_launch.py``.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from megamoe.kernels import runtime  # noqa: E402
from support.oracle import run_backend  # noqa: E402
from support.problems import Case, make_problem  # noqa: E402

DEV = torch.device("cuda")
# a qwen3-30b-like layer with a shared expert (every kernel of backend triton's step)
CASE = Case(1000, 2048, 768, 64, 8, shared=512, block_rows=128)
FP8 = dict(precision="fp8", minibatch_rows=1024, ring_rows=None)


@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * scale + y, mask=mask)


@pytest.fixture(autouse=True)
def _direct_launches(monkeypatch):
    monkeypatch.setattr(runtime, "_DIRECT", True)


class _CountingRun:
    """Counts the launches that go through Triton's ``JITFunction.run`` of one kernel (an
    instance attribute: the class's launch path stays the one ``runtime.launch`` knows)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, 0
        self.original = JITFunction.run.__get__(kernel)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def _add(x, y, out, n, scale) -> None:
    runtime.launch(_scaled_add_kernel, (triton.cdiv(n, 256),), x, y, out, n, scale, BLOCK=256)


def test_second_launch_skips_triton_path_and_new_specialization_compiles(monkeypatch) -> None:
    counting = _CountingRun(_scaled_add_kernel)
    monkeypatch.setattr(_scaled_add_kernel, "run", counting)
    x, y = torch.randn(4096, device=DEV), torch.randn(4096, device=DEV)
    for scale in (2.0, -0.5, 3.0):  # (floats are not specialized: one compiled kernel)
        out = torch.full_like(x, float("nan"))
        _add(x, y, out, 4096, scale)
        torch.testing.assert_close(out, x * scale + y)
    assert counting.calls == 1, "the second and third launches went through Triton's path"
    # n = 1 and a base 4 bytes past 16-byte alignment are other specializations: each goes
    # through Triton's path once (compiling), then is found directly
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        _add(x, y, out, 1, 2.0)
        torch.testing.assert_close(out[0], x[0] * 2.0 + y[0])
        assert out[1:].isnan().all()
        out = torch.full_like(x, float("nan"))
        _add(x[1:], y[1:], out[1:], 4095, 2.0)
        torch.testing.assert_close(out[1:], x[1:] * 2.0 + y[1:])
        assert out[0].isnan()
    assert counting.calls == 3


def test_launch_hooks_patched_run_and_switch_take_triton_path(monkeypatch) -> None:
    counting = _CountingRun(_scaled_add_kernel)
    monkeypatch.setattr(_scaled_add_kernel, "run", counting)
    x, y, out = (torch.randn(1024, device=DEV) for _ in range(3))
    _add(x, y, out, 1024, 1.0)
    calls = counting.calls
    _add(x, y, out, 1024, 1.0)
    assert counting.calls == calls  # (direct)
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        _add(x, y, out, 1024, 1.0)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert counting.calls == calls + 1 and len(seen) == 1
    original = JITFunction.run
    with monkeypatch.context() as patch:
        patch.setattr(JITFunction, "run", lambda self, *a, **k: original(self, *a, **k))
        _add(x, y, out, 1024, 1.0)
    assert counting.calls == calls + 2
    monkeypatch.setattr(runtime, "_DIRECT", False)  # (MEGAMOE_DIRECT_LAUNCH=0)
    _add(x, y, out, 1024, 1.0)
    assert counting.calls == calls + 3


def test_unhashable_specialization_takes_triton_path(monkeypatch) -> None:
    counting = _CountingRun(_scaled_add_kernel)
    monkeypatch.setattr(_scaled_add_kernel, "run", counting)
    x, y = torch.randn(512, device=DEV), torch.randn(512, device=DEV)
    _add(x, y, torch.empty_like(x), 512, 1.0)  # (the binder is known from here on)
    key = (_scaled_add_kernel, torch.cuda.current_device())
    binder = runtime._BINDERS[key]

    def unhashable(*args, **kwargs):
        bound, spec, opts = binder(*args, **kwargs)
        return bound, [*spec, ("list", [1])], opts

    monkeypatch.setitem(runtime._BINDERS, key, unhashable)
    calls = counting.calls
    out = torch.full_like(x, float("nan"))
    _add(x, y, out, 512, 2.0)
    torch.testing.assert_close(out, x * 2.0 + y)
    assert counting.calls == calls + 1


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_training_step_bits_same_as_triton_path(precision: str, monkeypatch) -> None:
    """A training step of backend triton launched directly gives the bits of the same step
    launched through Triton's path."""
    p = make_problem(CASE, seed=3, device=DEV, **(FP8 if precision == "fp8" else {}))
    run_backend(p)  # (every kernel launched once: the next step launches them directly)
    fast = run_backend(p)
    original = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: original(self, *a, **k))
    slow = run_backend(p)
    torch.testing.assert_close(fast[0], slow[0], rtol=0, atol=0)
    for name, a, b in zip(fast[1]._fields, fast[1], slow[1]):
        if a is not None:
            assert torch.equal(a, b), name
