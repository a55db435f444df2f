"""Probe: variants of the warp-specialized Gluon kernel of the fp8 forward ``grouped_mm``.

``megamoe.kernels.fp8_ws`` (the library's kernel; its docstring has the design) splits a CTA
into one TMA producer warp and two consumer warpgroups, each promoting its 64 x 128 partial
products while the other's wgmma runs. This probe times it beside ``fp8_gemm.grouped_mm``
(the Triton kernel) and beside variants of its consumers, built from the same producer and
scale loads:

  * ``early``: the scales' product taken as soon as they are loaded, the first version's
    order. ptxas then placed that multiply, and with it a wait for the global loads, right
    before the next wgmma issue: every K step paid the loads' latency. (2026-12-02's probe
    ran this order: 1.02x the Triton kernel on the long-K GEMM, 1.2x on down.)
  * ``pingpong``: two more mbarriers hand the right to issue the next wgmma from consumer 0
    to consumer 1 and back, right after each issue, so the tensor cores take 0:k, 1:k, 0:k+1,
    ... back to back and each consumer promotes while the other's wgmma runs.
  * ``ceiling``: no block scales; the tensor cores accumulate over all of K (wrong numbers,
    not checked): the speed of the pipeline alone.

Each variant's output is compared with the Triton kernel's bits and with float64 on a few
experts; the plain variant is the library kernel's consumer loop. (Issuing step k+1's wgmma
before promoting step k, a second partial accumulator in flight, made ptxas serialize the
wgmmas (C7515) and spill; 64 x 256 tiles, the consumers side by side along N, ran 0.84-0.91x
the Triton kernel in 2026-12-02's run. Both were dropped.)

    # on any machine (no GPU): compile for sm_90a, print registers/spills/smem, check the PTX
    # (wgmma present, no local memory, no spills, no ptxas wgmma-serialization warning)
    PYTHONPATH=. python benchmarks/probes/gluon_fp8_gemm.py --compile-only
    # on one H200: correctness against grouped_mm and float64, timing, JSON record
    PYTHONPATH=. python benchmarks/probes/gluon_fp8_gemm.py --out gluon_fp8.json
    # fewer variants or shapes: --variants 128x128:4,128x128:4:pingpong --shapes down
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from megamoe.kernels import fp8_ws
from megamoe.kernels.fp8 import BLOCK, FP8, Fp8Weight
from megamoe.kernels.fp8_ws import (
    ACC_LAYOUT,
    BK,
    CONSUMER_REGS,
    HALF_ROWS,
    KERNEL_MAXNREG,
    PRODUCER_REGS,
    TILE_COLS,
    _nvmma,
    _producer,
    _shared_ring,
    _step_scales,
    _store_tiles,
    _tile_origin,
    _tile_walk,
)
from megamoe.kernels.gemm import weight_2d
from megamoe.kernels.runtime import empty, launch_grid
from megamoe.kernels.schedule import RowSchedule

SMEM_LIMIT = fp8_ws.SMEM_BYTES
H200_SMS = 132

# ------------------------------------------------------------------------------------ kernel


@gluon.jit
def _early(scale, EARLY: gl.constexpr):
    """(``early``) the scales' product taken at once, where they are loaded."""
    if EARLY:
        sa, sb = scale
        return sa * sb
    else:
        return scale


@gluon.jit
def _k_step(acc, d, scale, ring, turn, it, HALF: gl.constexpr, PINGPONG: gl.constexpr,
            EARLY: gl.constexpr):  # fmt: skip
    """``fp8_ws._k_step`` with the variants' options. (pingpong) ``turn[w]`` completes a phase
    when warpgroup w may issue its next wgmma: warpgroup 0 issues its ring step j after
    warpgroup 1 issued step j - 1, warpgroup 1 its step j after warpgroup 0 issued step j;
    ``it`` counts the same ring steps in both, so the j-th wait of turn[0] (parity
    (j & 1) ^ 1; the first passes on a fresh barrier) meets warpgroup 1's arrival j - 1, the
    j-th wait of turn[1] (parity j & 1) warpgroup 0's arrival j."""
    a_bufs, b_bufs, ready, free, STAGES = ring
    slot = it % STAGES
    if PINGPONG:
        mbarrier.wait(turn.index(HALF), (it & 1) ^ (1 - HALF))
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    b = b_bufs.index(slot).permute((1, 0))
    d = warpgroup_mma(a_bufs.index(2 * slot + HALF), b, d, use_acc=False, is_async=True)
    if PINGPONG:  # hand the turn over as soon as the wgmma is issued
        mbarrier.arrive(turn.index(1 - HALF), count=1)
    d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
    mbarrier.arrive(free.index(slot), count=1)
    if EARLY:
        return acc + d * scale[:, None], d
    else:
        sa, sb = scale
        return acc + d * (sa * sb)[:, None], d


@gluon.jit
def _consumer(
    c_desc, c_bufs, ring, turn, scales, sched, N, K, HALF: gl.constexpr,
    BLOCK_TILES: gl.constexpr, NUM_PROGS: gl.constexpr, PINGPONG: gl.constexpr,
    EARLY: gl.constexpr, CEILING: gl.constexpr,
):  # fmt: skip
    """``fp8_ws._consumer`` with the variants' options.

    (pingpong) No deadlock: both warpgroups walk the same tiles with the same K steps, so each
    makes as many turn waits as the other makes arrivals; warpgroup 0's wait j needs only
    warpgroup 1's step j - 1 issued, warpgroup 1's wait j only warpgroup 0's step j issued, and
    a step's issue needs only its ring slot, which the producer fills once both released step
    j - STAGES: every wait depends only on earlier events in the order 0:0, 1:0, 0:1, 1:1, ...
    Neither barrier gets more than one phase ahead of its waiter, so no parity wait misses a
    phase."""
    a_bufs, b_bufs, ready, free, STAGES = ring
    row_layout: gl.constexpr = gl.SliceLayout(1, ACC_LAYOUT)
    c_smem = c_bufs.index(HALF)
    walk, num_tiles = _tile_walk(sched, N, BLOCK_TILES, TILE_COLS)
    k_steps = gl.cdiv(K, BK)
    zero = gl.zeros([HALF_ROWS, TILE_COLS], gl.float32, ACC_LAYOUT)
    d = zero
    it = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGS):
        expert, row, col = _tile_origin(tile, walk, BLOCK_TILES, TILE_COLS, 1)
        row += HALF * HALF_ROWS
        rows = row + gl.arange(0, HALF_ROWS, layout=row_layout)
        acc = zero
        if CEILING:
            for kb in range(k_steps):
                slot = it % STAGES
                mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
                b = b_bufs.index(slot).permute((1, 0))
                acc = warpgroup_mma(a_bufs.index(2 * slot + HALF), b, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(free.index(slot), count=1)
                it += 1
        else:
            scale0 = _early(_step_scales(scales, expert, rows, col, 0), EARLY)
            for kb in range(0, k_steps - 1, 2):
                scale1 = _early(_step_scales(scales, expert, rows, col, kb + 1), EARLY)
                acc, d = _k_step(acc, d, scale0, ring, turn, it, HALF, PINGPONG, EARLY)
                last = gl.minimum(kb + 2, k_steps - 1)
                scale0 = _early(_step_scales(scales, expert, rows, col, last), EARLY)
                acc, d = _k_step(acc, d, scale1, ring, turn, it + 1, HALF, PINGPONG, EARLY)
                it += 2
            if k_steps % 2:
                acc, d = _k_step(acc, d, scale0, ring, turn, it, HALF, PINGPONG, EARLY)
                it += 1
        _store_tiles((c_desc,), (c_smem,), (acc,), [row, col])
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["M", "N", "K", "w_rows", "s_am", "s_ak", "s_be", "s_bn", "s_bk"])
def _variant_kernel(
    a_desc, a_s_ptr, b_desc, b_s_ptr, c_desc, block_expert_ptr, num_blocks_ptr,
    M, N, K, w_rows, s_am, s_ak, s_be, s_bn, s_bk,
    STAGES: gl.constexpr, BLOCK_TILES: gl.constexpr, NUM_PROGS: gl.constexpr,
    PINGPONG: gl.constexpr, EARLY: gl.constexpr, CEILING: gl.constexpr,
):  # fmt: skip
    """``fp8_ws._ws_grouped_mm_kernel`` with the variants' consumers (and, for pingpong, the
    two turn barriers)."""
    ring, c_bufs = _shared_ring(a_desc, b_desc, c_desc, STAGES)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    scales = (a_s_ptr, (b_s_ptr,), M, N, s_am, s_ak, s_be, s_bn, s_bk)
    sched = (block_expert_ptr, num_blocks_ptr)
    gl.warp_specialize(
        [
            (_consumer, (c_desc, c_bufs, ring, turn, scales, sched, N, K, 0, BLOCK_TILES,
                         NUM_PROGS, PINGPONG, EARLY, CEILING)),
            (_consumer, (c_desc, c_bufs, ring, turn, scales, sched, N, K, 1, BLOCK_TILES,
                         NUM_PROGS, PINGPONG, EARLY, CEILING)),
            (_producer, (((a_desc, (b_desc,), w_rows),), ring, sched, N, K, False, BLOCK_TILES,
                         NUM_PROGS, TILE_COLS, 1)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


# -------------------------------------------------------------------------------------- host

VARIANT_OPTIONS = ("pingpong", "early", "ceiling")


@dataclass(frozen=True)
class Variant:
    """``stages`` ring slots and the options of the module docstring."""

    stages: int = 4
    pingpong: bool = False
    early: bool = False
    ceiling: bool = False

    @property
    def name(self) -> str:
        options = ":pingpong" * self.pingpong + ":early" * self.early
        return f"128x128:{self.stages}{options}" + ":ceiling" * self.ceiling

    @staticmethod
    def parse(text: str) -> Variant:
        """``128x128:4``, ``128x128:4:pingpong``, ``128x128:4:pingpong:early`` (tile, stages,
        options)."""
        parts = text.split(":")
        options = set(parts[2:])
        if parts[0] != "128x128" or not options <= set(VARIANT_OPTIONS):
            raise ValueError(
                f"variant {text!r}: want 128x128[:stages], then options out of {VARIANT_OPTIONS}"
            )
        v = Variant(
            stages=int(parts[1]) if len(parts) > 1 else 4,
            pingpong="pingpong" in options,
            early="early" in options,
            ceiling="ceiling" in options,
        )
        if fp8_ws.smem_bytes(v.stages) + 16 > SMEM_LIMIT:
            raise ValueError(f"variant {text!r} needs too much shared memory")
        return v


# (128x128:6 was no faster than 128x128:4 in 2026-12-02's run.) Each order of the scales'
# product, plain and ping-pong, and the pipeline without scales.
DEFAULT_VARIANTS = (
    "128x128:4",
    "128x128:4:early",
    "128x128:4:pingpong",
    "128x128:4:pingpong:early",
    "128x128:4:ceiling",
)


def gluon_grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: Fp8Weight,
    sched: RowSchedule,
    variant: Variant = Variant(),
    programs: int | None = None,
) -> torch.Tensor:
    """C[r] = a[r] @ w.q[e(r)]^T in bf16 by a variant kernel, like ``fp8_gemm.grouped_mm``
    (same arguments, same written rows: the used row blocks)."""
    if a.dtype != FP8 or a.dim() != 2 or a.stride(1) != 1 or a.shape[1] % 16:
        raise ValueError(f"a must be float8_e4m3fn [rows, K], K % 16 == 0, got {a.shape}")
    rows, k = a.shape
    q, s = w.q, w.scale
    n = q.shape[1]
    if q.dtype != FP8 or q.shape[2] != k or n % 8:
        raise ValueError(f"w.q must be float8_e4m3fn [E, N, {k}], N % 8 == 0, got {q.shape}")
    if list(a_scale.shape) != [rows, triton.cdiv(k, BK.value)]:
        raise ValueError(f"a_scale must be [{rows}, {triton.cdiv(k, BK.value)}]")
    if sched.block_rows % fp8_ws.TILE_ROWS:
        raise ValueError(f"block_rows {sched.block_rows} is not a multiple of 128")
    wb, w_rows = weight_2d(q)
    out = empty((rows, n), torch.bfloat16, a.device)
    block_tiles = sched.block_rows // fp8_ws.TILE_ROWS
    grid = launch_grid(
        sched.max_blocks * block_tiles * triton.cdiv(n, TILE_COLS.value), a.device, programs
    )
    _variant_kernel[grid](
        _nvmma(a, [HALF_ROWS.value, BK.value]),
        a_scale,
        _nvmma(wb, [TILE_COLS.value, BK.value]),
        s,
        _nvmma(out, [HALF_ROWS.value, TILE_COLS.value]),
        sched.block_expert,
        sched.num_blocks,
        rows,
        n,
        k,
        w_rows,
        *a_scale.stride(),
        *s.stride(),
        STAGES=variant.stages,
        BLOCK_TILES=block_tiles,
        NUM_PROGS=grid[0],
        PINGPONG=variant.pingpong,
        EARLY=variant.early,
        CEILING=variant.ceiling,
        num_warps=4,
        maxnreg=KERNEL_MAXNREG,
    )
    return out


# ------------------------------------------------------------------------------ compile only


def _meta_problem(experts: int, rows_per_expert: int, n: int, k: int):
    """Meta tensors (no memory) of one grouped_mm problem: A, its MN-major 1x128 scales, the
    weight and a schedule of ``experts * rows_per_expert`` rows in 128-row blocks."""
    from megamoe.kernels.schedule import build_row_schedule

    ids = torch.empty((experts * rows_per_expert, 1), dtype=torch.int64, device="meta")
    sched = build_row_schedule(ids, experts, 128)
    kb = triton.cdiv(k, BK.value)
    a = torch.empty((sched.rows, k), dtype=FP8, device="meta")
    a_scale = torch.empty((kb, sched.rows), dtype=torch.float32, device="meta").t()
    w = Fp8Weight(
        torch.empty((experts, n, k), dtype=FP8, device="meta"),
        torch.empty((experts, triton.cdiv(n, 128), kb), dtype=torch.float32, device="meta"),
    )
    return a, a_scale, w, sched


def _ptx_counts(ptx: str) -> dict:
    """What the PTX says about the main loop: the wgmma shapes, local memory, FMAs."""
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    return dict(
        wgmma=shapes,
        wgmma_count=ptx.count("wgmma.mma_async"),
        local_memory="ld.local" in ptx or "st.local" in ptx,
        setmaxnreg=",".join(
            sorted(
                {
                    a + b
                    for a, b in re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)
                }
            )
        ),
        fma_f32=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        mul_f32=len(re.findall(r"\bmul\.(?:rn\.)?f32\b", ptx)),
        add_f32=len(re.findall(r"\badd\.(?:rn\.)?f32\b", ptx)),
    )


def _ptxas(ptx: str) -> dict:
    """``ptxas -v`` for sm_90a: registers, spill and stack bytes, and its performance warnings
    (e.g. C7514/C7515: wgmma serialized because registers of an in-flight accumulator were
    read or written)."""
    import subprocess
    import tempfile

    from megamoe.tools.compile_check import _PTXAS

    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        info = subprocess.run(
            [_PTXAS, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [os.path.join(os.path.dirname(_PTXAS), "cuobjdump"), "-sass", f"{tmp}/k.cubin"],
            capture_output=True,
            text=True,
        ).stdout

    def number(pattern: str) -> int:
        found = re.search(pattern, info)
        return int(found.group(1)) if found else 0

    # ptxas reports the launch's register count (maxnreg); the warpgroups that setmaxnreg
    # raises use more: the highest register the SASS names tells how many.
    used = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    return dict(
        registers=number(r"Used (\d+) registers"),
        sass_max_register=max(used) + 1 if used else None,
        spill_bytes=number(r"(\d+) bytes spill stores"),
        stack_bytes=number(r"(\d+) bytes (?:stack frame|cumulative stack size)"),
        ptxas_warnings=sorted(set(re.findall(r"\((C\d+)\) Potential Performance Loss", info))),
    )


def compile_only(variants: list[Variant], keep: str | None = None) -> int:
    """Compile each variant kernel and ``fp8_gemm.grouped_mm``'s (on Hopper: ``fp8_ws``) for
    sm_90a on this machine, print registers, spills and shared memory, and check the PTX:
    wgmma, no local memory, no spills, shared memory within the limit. Returns the exit
    status."""
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    from megamoe.kernels import fp8_gemm
    from megamoe.kernels.runtime import assume_programs, interpreting
    from megamoe.tools.compile_check import HOPPER, record_launches

    if interpreting():
        print("run with TRITON_INTERPRET unset (the interpreter cannot compile)")
        return 2
    label = ["?"]
    with assume_programs(H200_SMS), record_launches(lambda: label[0]) as launches:
        for shape, (n, k) in (("down", (7168, 2048)), ("gate", (4096, 7168))):
            problem = _meta_problem(32, 512, n, k)
            for v in variants:
                label[0] = f"gluon {v.name}"  # (one specialization for both shapes)
                gluon_grouped_mm(*problem, variant=v)
            label[0] = f"fp8_gemm.grouped_mm {shape}"
            fp8_gemm.grouped_mm(*problem)
    failures = []
    results = []
    for launch in launches:
        if launch.scenario == "?":  # the schedule's kernels (meta inputs), not compiled
            continue
        options = {
            k: v
            for k, v in launch.options.items()
            if k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
        }
        source = GluonASTSource if launch.fn.is_gluon() else ASTSource
        src = source(launch.fn, launch.signature, constexprs=launch.constexprs, attrs=launch.attrs)
        kernel = triton_compile(src, target=HOPPER, options=options)
        ptx = kernel.asm["ptx"]
        r = dict(
            kernel=launch.scenario,
            shared=kernel.metadata.shared,
            num_warps=kernel.metadata.num_warps,
            **_ptxas(ptx),
            **_ptx_counts(ptx),
        )
        results.append(r)
        print(
            f"{r['kernel']:30s} regs={r['registers']:3d} (SASS {r['sass_max_register']}) "
            f"spill={r['spill_bytes']:4d} "
            f"stack={r['stack_bytes']:3d} smem={r['shared']:6d} warps={r['num_warps']:2d} "
            f"wgmma={','.join(r['wgmma'])}x{r['wgmma_count']} setmaxnreg={r['setmaxnreg']} "
            f"fma={r['fma_f32']} mul={r['mul_f32']} add={r['add_f32']} "
            f"ptxas_warnings={r['ptxas_warnings']}"
        )
        if not r["wgmma"]:
            failures.append(f"{r['kernel']}: no wgmma in the PTX")
        if r["spill_bytes"] or r["local_memory"] or r["stack_bytes"]:
            failures.append(f"{r['kernel']}: spills/local memory/stack")
        if r["ptxas_warnings"]:
            failures.append(f"{r['kernel']}: ptxas serializes wgmma {r['ptxas_warnings']}")
        if r["shared"] > SMEM_LIMIT:
            failures.append(f"{r['kernel']}: {r['shared']} B of shared memory > {SMEM_LIMIT}")
        if keep:
            name = re.sub(r"\W+", "_", launch.scenario)
            for ext in ("ttgir", "ptx"):
                with open(f"{keep}/{name}.{ext}", "w") as f:
                    f.write(kernel.asm[ext])
    for f in failures:
        print("FAIL", f)
    print("compile-only:", "FAILED" if failures else "ok")
    return 1 if failures else 0


# -------------------------------------------------------------------------------------- GPU

# (label, experts, routed rows per expert on average, N, K): DeepSeek-V3 (H 7168, I 2048), one
# routed row per token, uneven expert loads (random top-1 ids), 128-row blocks.
SHAPES = (
    ("down E32 8192 rows", 32, 256, 7168, 2048),
    ("down E32 32768 rows", 32, 1024, 7168, 2048),
    ("gate E8 16384 rows", 8, 2048, 4096, 7168),
    ("gate E32 32768 rows", 32, 1024, 4096, 7168),
)
# Pass/fail bound on max |C - C_fp64| / max |C_fp64| (per expert): rounding to bf16 alone is
# up to 2^-8 of an element; this leaves room for the tensor cores' and fp32 accumulation.
NORM_ERR_LIMIT = 2.0**-7


def _problem(experts: int, per_expert: int, n: int, k: int, seed: int):
    """GPU inputs built with megamoe's own quantizers, rows in the padded layout."""
    from megamoe.kernels import fp8
    from megamoe.kernels.schedule import build_row_schedule
    from megamoe.tools.bench_kernels import rows_padded

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    tokens = experts * per_expert
    ids = torch.randint(0, experts, (tokens, 1), device=dev, generator=gen)
    sched = build_row_schedule(ids, experts, 128)
    x = torch.randn(tokens, k, device=dev, generator=gen).bfloat16()
    # token-major x into the padded layout (zeros in the padding rows), then 1x128-quantized
    a, a_scale = fp8.quantize_rows(rows_padded(x, sched))
    w = fp8.quantize_weight(torch.randn(experts, n, k, device=dev, generator=gen).bfloat16() * 0.05)
    return a, a_scale, w, sched, tokens


def _errors(
    outs: dict[str, torch.Tensor], a, a_scale, w: Fp8Weight, sched, experts: list[int]
) -> dict:
    """Per output, over the rows of ``experts``: max |C - C_fp64|, that over max |C_fp64| (per
    expert, the worst), the max elementwise relative error where |C_fp64| >= 1% of the
    expert's max, and the non-finite count; C_fp64 is the float64 product of the dequantized
    operands, expert by expert (padding rows included: they must be 0)."""
    from megamoe.kernels import fp8

    starts = sched.row_start.tolist()
    stats = {name: dict(max_abs=0.0, max_norm=0.0, max_rel=0.0, nonfinite=0) for name in outs}
    for e in experts:
        r0, r1 = starts[e], starts[e + 1]
        if r1 == r0:
            continue
        a_e = fp8.dequantize_rows(a[r0:r1], a_scale[r0:r1]).double()
        s = w.scale[e].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        w_e = w.q[e].double() * s[: w.q.shape[1], : w.q.shape[2]].double()
        ref = a_e @ w_e.T
        big = ref.abs().max().item()
        for name, c in outs.items():
            err = (c[r0:r1].double() - ref).abs()
            st = stats[name]
            st["nonfinite"] += int((~torch.isfinite(c[r0:r1])).sum().item())
            st["max_abs"] = max(st["max_abs"], err.max().item())
            if big > 0:
                st["max_norm"] = max(st["max_norm"], err.max().item() / big)
                keep = ref.abs() >= 0.01 * big
                st["max_rel"] = max(st["max_rel"], (err[keep] / ref.abs()[keep]).max().item())
    return stats


def _interleaved_ms(calls: dict, rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median CUDA-event time of one call of each, over ``rounds`` round-robin rounds."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    events = []
    for _ in range(rounds):
        for name, fn in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((name, start, end))
    torch.cuda.synchronize()
    for name, start, end in events:
        times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def _run_shape(shape: tuple, seed: int, variants: list[Variant], args, failures: list[str]):
    """One shape: every kernel's output checked, then all of them timed round robin."""
    from megamoe.kernels import fp8_gemm, fp8_ws

    label, experts, per_expert, n, k = shape
    a, a_scale, w, sched, tokens = _problem(experts, per_expert, n, k, seed)
    used = int(sched.num_blocks.item()) * sched.block_rows
    calls = {"triton": lambda: fp8_gemm.grouped_mm(a, a_scale, w, sched)}

    def library():  # the library's warp-specialized kernel (fp8_ws), 4 stages
        out = torch.empty((a.shape[0], n), dtype=torch.bfloat16, device=a.device)
        wb, w_rows = weight_2d(w.q)
        fp8_ws.launch_grouped_mm([(a, a_scale, wb, w.scale, w_rows)], sched, [out], 4)
        return out

    calls["fp8_ws:4"] = library
    for v in variants:
        calls[v.name] = lambda v=v: gluon_grouped_mm(a, a_scale, w, sched, variant=v)
    ceilings = {v.name for v in variants if v.ceiling}
    outs = {}
    for name, fn in calls.items():
        try:
            outs[name] = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a variant that does not compile or launch
            failures.append(f"{label}: {name} failed to run: {exc!r}")
            print(f"FAIL {label}: {name}: {exc!r}")
    calls = {name: fn for name, fn in calls.items() if name in outs}
    # float64 references of a few experts (first, middle, last) keep the run short; the
    # bitwise comparison covers every written row.
    ref_experts = sorted({0, experts // 2, experts - 1})[: max(1, args.ref_experts)]
    errs = _errors(outs, a, a_scale, w, sched, ref_experts)
    ms = _interleaved_ms(calls, args.rounds)
    flop = 2.0 * tokens * n * k  # routed rows only (padding rows are not work)
    entry = dict(label=label, experts=experts, tokens=tokens, used_rows=used, n=n, k=k)
    entry["reference_experts"] = ref_experts
    entry["kernels"] = {}
    base = outs.get("triton")
    for name in calls:
        same = bool(torch.equal(outs[name][:used], base[:used])) if base is not None else None
        e = errs[name]
        speedup = ms["triton"] / ms[name] if "triton" in ms else None
        entry["kernels"][name] = dict(
            ms=ms[name],
            tflops=flop / ms[name] / 1e9,
            speedup=speedup,
            bitwise_equal_to_triton=same,
            **e,
        )
        checked = name not in ceilings
        entry["kernels"][name]["checked"] = checked
        if checked and (e["nonfinite"] or e["max_norm"] > NORM_ERR_LIMIT):
            failures.append(
                f"{label}: {name} max|C-C64|/max|C64| = {e['max_norm']:.3g} "
                f"(limit {NORM_ERR_LIMIT:.3g}), {e['nonfinite']} non-finite"
            )
        if checked and args.require_bitwise and same is False:
            failures.append(f"{label}: {name} is not bitwise equal to grouped_mm")
        print(
            f"{label:22s} {name:16s} {ms[name]:7.3f} ms {flop / ms[name] / 1e9:7.1f} TFLOP/s "
            f"x{speedup or 0:.3f}  bitwise={same}  max_abs={e['max_abs']:.3g} "
            f"norm={e['max_norm']:.3g} rel={e['max_rel']:.3g}",
            flush=True,
        )
    return entry


def gpu_main(variants: list[Variant], args) -> int:
    """Correctness (bits against grouped_mm, error against float64) and interleaved timing of
    grouped_mm and each variant at each shape; a JSON record; non-zero on a failure."""
    if not torch.cuda.is_available():
        print("no CUDA device: use --compile-only on this machine")
        return 2
    if args.rounds < 20:
        print("--rounds must be at least 20")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [s for s in SHAPES if not args.shapes or any(w in s[0] for w in args.shapes)]
    record = dict(
        gpu=torch.cuda.get_device_name(),
        commit=os.environ.get("MEGAMOE_COMMIT"),
        torch=torch.__version__,
        triton=triton.__version__,
        rounds=args.rounds,
        norm_err_limit=NORM_ERR_LIMIT,
        variants=[v.name for v in variants],
        shapes=[],
    )
    failures: list[str] = []
    for seed, shape in enumerate(shapes):
        record["shapes"].append(_run_shape(shape, seed, variants, args, failures))
        torch.cuda.empty_cache()
    record["failures"] = failures
    record["ok"] = not failures
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    for f in failures:
        print("CORRECTNESS FAILED:", f)
    print("gpu mode:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="no GPU: compile and check")
    parser.add_argument("--keep", help="(compile-only) write each kernel's TTGIR/PTX here")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated tile variants: 128x128[:stages][:pingpong][:early][:ceiling]",
    )
    parser.add_argument("--out", help="(GPU) write the JSON record here")
    parser.add_argument("--rounds", type=int, default=25, help="(GPU) timed rounds, >= 20")
    parser.add_argument(
        "--shapes", nargs="*", help="(GPU) only shapes whose label contains one of these words"
    )
    parser.add_argument(
        "--ref-experts", type=int, default=3, help="(GPU) first/middle/last experts vs float64"
    )
    parser.add_argument(
        "--require-bitwise",
        action="store_true",
        help="(GPU) also fail when an output is not bitwise grouped_mm's",
    )
    args = parser.parse_args(argv)
    variants = [Variant.parse(v) for v in args.variants.split(",") if v]
    if args.compile_only:
        return compile_only(variants, args.keep)
    return gpu_main(variants, args)


if __name__ == "__main__":
    sys.exit(main())
