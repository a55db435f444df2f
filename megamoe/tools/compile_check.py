"""Compile every kernel variant the backends launch for Hopper (sm_90a), on any machine, no GPU.

The launches are recorded, not listed by hand: the backends' own host code runs on meta tensors
(real model sizes, no memory) under :func:`record_launches`, which intercepts each Triton launch
and specializes its arguments with Triton's own binder for an sm_90a target, as a launch on an
H200 would (types, 16-byte alignment, ints equal to 1). Each distinct specialization is compiled
with ``triton.compile`` (the whole pipeline including ptxas) and reported: shared memory,
registers, spills and stack (``ptxas -v``), local memory in the PTX, wgmma and TMA use.

    python -m megamoe.tools.compile_check            # a table
    python -m megamoe.tools.compile_check --json     # one JSON list (the CPU tests read it)

Must run with ``TRITON_INTERPRET`` unset: under the interpreter ``@triton.jit`` gives
interpreted functions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.runtime.jit import JITFunction, create_function_from_signature

__all__ = [
    "HOPPER",
    "SMEM_LIMIT",
    "H200_SMS",
    "Launch",
    "record_launches",
    "scenarios",
    "recorded_launches",
    "compile_launch",
    "main",
]

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one H100/H200 block may use
H200_SMS = 132
_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@dataclass
class Launch:
    """One specialization of a kernel, as a GPU launch would compile it."""

    name: str  # the kernel's function name
    scenario: str  # the first scenario that launched it
    fn: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    key: str


@contextlib.contextmanager
def record_launches(scenario: Callable[[], str]) -> Iterator[list[Launch]]:
    """Within this block no Triton kernel runs: each launch (and warm-up) is specialized for
    sm_90a and appended, once per distinct specialization, to the yielded list; ``scenario()``
    labels it."""
    backend = make_backend(HOPPER)
    launches: list[Launch] = []
    seen: set[str] = set()
    binders: dict[int, Callable] = {}
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        binder = binders.get(id(self))
        if binder is None:
            binder = binders[id(self)] = create_function_from_signature(
                self.signature, self.params, backend
            )
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        key = repr(
            (
                self.fn.__qualname__,
                signature,
                sorted(constexprs.items(), key=str),
                sorted(attrs.items(), key=str),
                sorted(options.__dict__.items()),
            )
        )
        if key not in seen:
            seen.add(key)
            launches.append(
                Launch(
                    self.fn.__name__,
                    scenario(),
                    self,
                    signature,
                    constexprs,
                    attrs,
                    dict(options.__dict__),
                    key,
                )
            )
        return None

    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = original


# ----------------------------------------------------------------------------------- scenarios


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _problem(cfg, tokens: int, world_size: int = 1):
    from ..types import ExpertWeights

    e = cfg.local_experts(world_size)
    h, i, i_s = cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
    shared = (_meta(i_s, h), _meta(i_s, h), _meta(h, i_s)) if i_s else (None, None, None)
    weights = ExpertWeights(_meta(e, i, h), _meta(e, i, h), _meta(e, h, i), *shared)
    ids = torch.empty((tokens, cfg.top_k), dtype=torch.int64, device="meta")
    return _meta(tokens, h), ids, _meta(tokens, cfg.top_k, dtype=torch.float32), weights


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` within the block (the backends' opt-in switches)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _train_step(backend, cfg, tokens: int) -> None:
    x, ids, w, weights = _problem(cfg, tokens)
    sched = backend.build_schedule(ids, cfg, None)
    _, ctx = backend.forward(x, ids, w, weights, cfg, None, sched)
    backend.backward(ctx, x)


def _ep_step(cfg, tokens: int, world_size: int, backend=None) -> None:
    """Rank 0's launches of one expert-parallel training step of backend "triton" (or of
    ``backend`` "fused"'s forward)."""
    from ..backends import steps
    from ..ep.workspace import emulated_workspaces

    ws = emulated_workspaces(world_size, tokens, cfg.hidden_size, cfg.top_k, device="meta")[0]
    x, ids, w, weights = _problem(cfg, tokens, world_size)
    sched = steps.run_steps(steps.schedule_steps(ids, cfg, ws), ws)
    forward = steps.forward_steps if backend is None else backend.forward_steps
    _, ctx = steps.run_steps(forward(x, w, weights, sched), ws)
    steps.run_steps(steps.backward_steps(ctx, x), ws)


def _comm_extras(tokens: int, hidden: int, top_k: int, world_size: int) -> None:
    """The copies no backend step launches with these options: the scaled pull."""
    from ..ep.workspace import emulated_workspaces
    from ..kernels import comm
    from ..kernels.schedule import build_row_schedule

    ws = emulated_workspaces(world_size, tokens, hidden, top_k, device="meta")[0]
    ids = torch.empty((world_size * tokens, top_k), dtype=torch.int32, device="meta")
    sched = build_row_schedule(ids, 32, 128)
    comm.dispatch_pull(ws, sched, "dy", scale=True)


def _fp8_step(cfg, tokens: int) -> None:
    """Every launch of the fp8 quantizers and block-scaled GEMMs in one training step, called
    directly on quantize_rows' operands (the backends' steps feed them packed dispatched rows:
    the "triton fp8" scenarios; docs/fp8.md)."""
    from ..kernels import adamw, fp8, fp8_gemm
    from ..kernels.schedule import build_row_schedule

    e, h, i = cfg.local_experts(1), cfg.hidden_size, cfg.intermediate_size
    ids = torch.empty((tokens, cfg.top_k), dtype=torch.int64, device="meta")
    s = build_row_schedule(ids, e, cfg.block_rows)
    w_gate, w_up = (fp8.quantize_weight(_meta(e, i, h), transposed=True) for _ in range(2))
    w_down = fp8.quantize_weight(_meta(e, h, i), transposed=True)
    fp8.quantize_weight(_meta(e, h, i))
    fp8.quantize_weight(_meta(e, h, i), transposed=True, plain=False)
    g, u, hq, _ = fp8_gemm.gate_up_quantized(*fp8.quantize_rows(_meta(s.rows, h)), w_gate, w_up, s)
    fp8_gemm.grouped_mm(*hq, w_down, s)
    dg, du = fp8_gemm.dgrad_swiglu(*fp8.quantize_rows(_meta(s.rows, h)), w_down, g, u, s)
    fp8_gemm.dgrad_pair(*fp8.quantize_rows(dg), w_gate, *fp8.quantize_rows(du), w_up, s)
    fp8_gemm.wgrad(*fp8.quantize_cols(dg), *fp8.quantize_cols(_meta(s.rows, h)), s)
    fp8.quantize_rows_cols(_meta(s.rows, h), pad_to=16)
    # the passes over a routed layout's used rows (d_z, d_g and d_u; x's 128x1 re-blocking)
    used = fp8_gemm.used_rows(s, s.rows)
    fp8.quantize_rows_cols(_meta(s.rows, h), pad_to=16, used=used)
    fp8.requantize_cols(*fp8.quantize_rows(_meta(s.rows, h)), used=used)
    # the optimizer's update (megamoe.optim.AdamW): writing the weights' copies, and plain
    hyper = adamw.AdamWStep(1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
    adamw.adamw_quantize_(*(_meta(e, i, h) for _ in range(4)), hyper)
    # fp32 weights (their transposed copies stored by address)
    fp8.quantize_weight(_meta(e, h, i, dtype=torch.float32), transposed=True)
    adamw.adamw_quantize_(*(_meta(e, i, h, dtype=torch.float32) for _ in range(4)), hyper)
    adamw.adamw_(*(_meta(e * h * i) for _ in range(4)), hyper)


def _fp8_step_with(cfg, tokens: int, warp_specialized: bool) -> None:
    """``_fp8_step`` with every GEMM that has a warp-specialized ``fp8_ws`` kernel on it (the
    weight gradients too, a sweep candidate), or with every GEMM on its Triton kernel, as GPUs
    other than Hopper run them."""
    import dataclasses

    from ..kernels import fp8_gemm

    old = dict(fp8_gemm.GPU_TILES)
    for kind, t in old.items():
        if not warp_specialized:
            triton = fp8_gemm.triton_tiles(kind, t)
            fp8_gemm.GPU_TILES[kind] = dataclasses.replace(triton, warp_specialized=False)
        elif not t.warp_specialized:
            fp8_gemm.GPU_TILES[kind] = dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, bn=t.bn)
    try:
        _fp8_step(cfg, tokens)
    finally:
        fp8_gemm.GPU_TILES.update(old)


def scenarios() -> list[tuple[str, Callable[[], None]]]:
    """(label, run) of every scenario recorded: dsv3's layer (and an odd row width) through
    each backend and the tunables that change the fused kernel's code."""
    from ..backends import fused, steps
    from ..backends import triton as unfused
    from ..shapes import get_preset

    dsv3 = get_preset("dsv3")
    tokens = 512  # (a runtime size: the code does not depend on it)
    cfg = dsv3.config(1)
    odd = cfg.replace(hidden_size=520, intermediate_size=200, shared_intermediate_size=200)
    ep = dsv3.config(8).replace(capacity_factor=2.0)
    ep2 = dsv3.config(2)

    def fused_step(config, trace: bool = False) -> Callable[[], None]:
        def run() -> None:
            x, ids, w, weights = _problem(config, tokens)
            sched = fused.build_schedule(ids, config, None)
            kernel_trace = (
                torch.empty((H200_SMS, 64, 3), dtype=torch.int64, device="meta") if trace else None
            )
            with _environ(fused.PIPELINED_FP8_ENV, "0"):  # (fp8: the fused kernel's tiles)
                _, ctx = fused.forward(x, ids, w, weights, config, None, sched, trace=kernel_trace)
            # the fused backward (opt-in: MEGAMOE_FUSED_BACKWARD=1; bf16 only), dy of x's shape
            with _environ(fused.FUSED_BACKWARD_ENV, "1" if config.precision == "bf16" else "0"):
                fused.backward(ctx, x)

        return run

    def fused_ep_step(pipelined: bool) -> Callable[[], None]:
        def run() -> None:
            with _environ(fused.PIPELINED_FP8_ENV, "1" if pipelined else "0"):
                _ep_step(ep2.replace(precision="fp8"), tokens, 2, fused)

        return run

    def pipelined_one_rank() -> None:
        # (one process runs backend triton's forward: the protocol on a one-rank workspace)
        config = cfg.replace(precision="fp8")
        x, ids, w, weights = _problem(config, tokens)
        with _environ(fused.PIPELINED_FP8_ENV, "1"):
            sched = fused.build_schedule(ids, config, None)
            x, w, weights, sched = steps.prepare(x, ids, w, weights, config, None, sched)
            run = steps.single_rank(sched, ids)
            steps.run_steps(fused.forward_steps(x, w, weights, run), run.ep.workspace)

    one_kernel = cfg.replace(comm_kernel=False, ring_rows=None)
    return [
        ("triton dsv3 W=1", lambda: _train_step(unfused, cfg, tokens)),
        ("triton dsv3 W=2 (rank 0)", lambda: _ep_step(ep2, tokens, 2)),
        ("triton dsv3 W=8 (rank 0), capacity 2", lambda: _ep_step(ep, tokens, 8)),
        ("scaled pull", lambda: _comm_extras(tokens, cfg.hidden_size, cfg.top_k, 2)),
        ("fp8 dsv3 W=1 (kernels only)", lambda: _fp8_step(cfg, tokens)),
        (
            "fp8 dsv3 W=1 (kernels only), every warp-specialized GEMM",
            lambda: _fp8_step_with(cfg, tokens, warp_specialized=True),
        ),
        (
            "fp8 dsv3 W=1 (kernels only), Triton kernels only",
            lambda: _fp8_step_with(cfg, tokens, warp_specialized=False),
        ),
        (
            "triton fp8 dsv3 W=1",
            lambda: _train_step(unfused, cfg.replace(precision="fp8"), tokens - 7),
        ),
        ("triton fp8 dsv3 W=2 (rank 0)", lambda: _ep_step(ep2.replace(precision="fp8"), tokens, 2)),
        ("fused dsv3 comm kernel", fused_step(cfg)),
        ("fused dsv3 comm kernel traced", fused_step(cfg, trace=True)),
        ("fused dsv3 odd row width", fused_step(odd)),
        ("fused dsv3 one kernel", fused_step(one_kernel)),
        ("fused dsv3 one kernel traced", fused_step(one_kernel, trace=True)),
        (
            "fused dsv3 one kernel, ring of 4 minibatches",
            fused_step(cfg.replace(ring_rows=4 * cfg.minibatch_rows)),
        ),
        ("fused fp8 dsv3 one kernel", fused_step(cfg.replace(precision="fp8"))),
        ("fused fp8 dsv3 comm kernel", fused_step(cfg.replace(precision="fp8", comm_kernel=True))),
        ("fused fp8 dsv3 W=2 (rank 0)", fused_ep_step(pipelined=False)),
        # (the default on Hopper: the pulls beside the warp-specialized GEMMs)
        ("fused fp8 dsv3 pipelined, one-rank workspace", pipelined_one_rank),
        ("fused fp8 dsv3 pipelined W=2 (rank 0)", fused_ep_step(pipelined=True)),
    ]


def recorded_launches() -> list[Launch]:
    """Every distinct launch of :func:`scenarios` (an H200's grid sizes)."""
    from ..ep.checks import CHECK_ENV
    from ..kernels.runtime import assume_programs

    label = ["?"]
    os.environ[CHECK_ENV] = "off"  # no host reads of the (never written) records
    with assume_programs(H200_SMS), record_launches(lambda: label[0]) as launches:
        for name, run in scenarios():
            label[0] = name
            run()
    return launches


# ------------------------------------------------------------------------------------- compile


def _ptxas(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run(
            [_PTXAS, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, info)
        return int(found.group(1)) if found else 0

    return dict(
        registers=number(r"Used (\d+) registers"),
        spill_bytes=number(r"(\d+) bytes spill stores"),
        stack_bytes=number(r"(\d+) bytes stack frame"),
    )


def _launcher_error(kernel) -> str:
    """'' if the host launcher's C source of the compiled ``kernel`` can be generated, as its
    first launch on a GPU generates it, else the error: a kernel can compile and still have no
    launcher (Triton 3.6's takes no tensor descriptor inside a tuple argument)."""
    from triton.backends.nvidia.driver import make_launcher

    src = kernel.src
    arg_idx = lambda x: (src.fn.arg_names.index(x),) if isinstance(x, str) else x  # noqa: E731
    constants = {arg_idx(k): v for k, v in getattr(src, "constants", {}).items()}
    try:
        make_launcher(
            constants, dict(src.signature), getattr(kernel.metadata, "tensordesc_meta", None)
        )
    except Exception as exc:  # (reported: the tests assert there is none)
        return f"{type(exc).__name__} in make_launcher: {exc}".strip()
    return ""


def compile_launch(launch: Launch, keep_ptx: bool = False) -> dict:
    """Compile one recorded launch for sm_90a; report what the tests check."""
    options = {
        k: v
        for k, v in launch.options.items()
        if k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
    }
    from triton.experimental.gluon._runtime import GluonASTSource

    source = GluonASTSource if launch.fn.is_gluon() else ASTSource
    src = source(launch.fn, launch.signature, constexprs=launch.constexprs, attrs=launch.attrs)
    kernel = triton_compile(src, target=HOPPER, options=options)
    ptx = kernel.asm["ptx"]
    out = dict(
        name=launch.name,
        scenario=launch.scenario,
        shared=kernel.metadata.shared,
        num_warps=kernel.metadata.num_warps,
        wgmma="wgmma.mma_async" in ptx,
        tma="cp.async.bulk.tensor" in ptx,
        target_sm90a=".target sm_90a" in ptx,
        ptx_local="ld.local" in ptx,
        launcher_error=_launcher_error(kernel),
        **_ptxas(ptx),
    )
    if keep_ptx:
        out["ptx"] = ptx
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.tools.compile_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    parser.add_argument("--ptx", action="store_true", help="include each kernel's PTX (JSON)")
    args = parser.parse_args(argv)
    from ..kernels.runtime import interpreting

    if interpreting():
        parser.error("run with TRITON_INTERPRET unset (the interpreter cannot compile)")
    results = [compile_launch(launch, args.ptx) for launch in recorded_launches()]
    if args.json:
        print(json.dumps(results))
        return 0
    for r in results:
        print(
            f"{r['name']:24s} {r['scenario']:44s} smem={r['shared']:7d} "
            f"regs={r['registers']:3d} spill={r['spill_bytes']:4d} warps={r['num_warps']} "
            f"wgmma={r['wgmma']} tma={r['tma']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
