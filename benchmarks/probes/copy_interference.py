"""Probe (two GPUs): how much do concurrent NVLink copies slow the routed GEMMs, issued by SM
programs beside them (as the fused forward's comm kernel does), by a TMA-only copy kernel, or by
the copy engine (cudaMemcpyAsync of a peer buffer, no SM)? Numbers: BENCHMARKS.md, "Sustained
speed at the power cap" (record probes_copies_power_h200x2_86f3d6f_2026-11-30.json).

    PYTHONPATH=. torchrun --nproc-per-node=2 benchmarks/probes/copy_interference.py

Per rank: the dsv3 routed GEMMs of one W = 2 forward (gate/up + SwiGLU, down: megamoe's Triton
tiles, 32 local experts, 32768 rows) alone; 470 MB pulled from the peer (the forward's remote
pull + push volume) alone by P SM programs (4 or 2 warps, 16 KB tiles, with or without cache
hints), by a TMA copy kernel (Gluon, 8 KB boxes) or by the copy engine; and both at once on two
streams (GEMM time from its own stream's events). Medians of 7; the GPUs warm up during the
run, and 'gemms alone (again)' at the end shows by how much.
"""

import ctypes
import statistics

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

TMA_ROWS, TMA_COLS, TMA_STAGES = 16, 256, 3  # 8 KB boxes of a [n / 256, 256] view


@gluon.jit
def _tma_copy_kernel(src_desc, dst_desc, n_tiles, PROGS: gl.constexpr, STAGES: gl.constexpr):
    """Copy boxes global -> shared -> global with TMA only (no registers hold the data)."""
    BR: gl.constexpr = src_desc.block_type.shape[0]
    BC: gl.constexpr = src_desc.block_type.shape[1]
    smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BR, BC], src_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    pid = gl.program_id(0)
    n_mine = (n_tiles - pid + PROGS - 1) // PROGS
    for p in gl.static_range(STAGES - 1):
        mbarrier.expect(bars.index(p), BR * BC * 2, pred=p < n_mine)
        tma.async_copy_global_to_shared(
            src_desc, [(pid + p * PROGS) * BR, 0], bars.index(p), smem.index(p), pred=p < n_mine
        )
    for i in range(n_mine):
        s = i % STAGES
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        tma.async_copy_shared_to_global(dst_desc, [(pid + i * PROGS) * BR, 0], smem.index(s))
        j = i + STAGES - 1
        tma.store_wait(1)
        ok = j < n_mine
        sj = j % STAGES
        mbarrier.expect(bars.index(sj), BR * BC * 2, pred=ok)
        tma.async_copy_global_to_shared(
            src_desc, [(pid + j * PROGS) * BR, 0], bars.index(sj), smem.index(sj), pred=ok
        )
    tma.store_wait(0)


@triton.jit
def _copy_kernel(
    src_ptr, dst_ptr, n_tiles, TILE: tl.constexpr, PROGS: tl.constexpr, HINT: tl.constexpr
):
    offs = tl.arange(0, TILE)
    for t in range(tl.program_id(0), n_tiles, PROGS):
        base = t.to(tl.int64) * TILE
        if HINT == 1:  # stream: no L1 allocation for the load, evict-first in L2 both ways
            v = tl.load(src_ptr + base + offs, eviction_policy="evict_first")
            tl.store(dst_ptr + base + offs, v, cache_modifier=".cs")
        elif HINT == 2:
            v = tl.load(src_ptr + base + offs, cache_modifier=".cg")
            tl.store(dst_ptr + base + offs, v, eviction_policy="evict_first")
        else:
            tl.store(dst_ptr + base + offs, tl.load(src_ptr + base + offs))


def _carve(kernel):
    cuda = ctypes.CDLL("libcuda.so.1")
    kernel._init_handles()
    assert cuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), 9, 100) == 0


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    from torch.distributed import _symmetric_memory as symm_mem

    from megamoe.kernels import gemm
    from megamoe.kernels.schedule import build_row_schedule

    T, K, E, H, I = 4096, 8, 32, 7168, 2048
    g = torch.Generator(device=dev).manual_seed(rank)
    ids = torch.argsort(torch.rand(T, E, device=dev, generator=g), dim=1)[:, :K].to(torch.int32)
    sched = build_row_schedule(ids, E, 128)
    rows = sched.max_blocks * 128
    xs = torch.randn(rows, H, device=dev).to(torch.bfloat16)
    wg, wu = ((torch.randn(E, I, H, device=dev) * 0.02).to(torch.bfloat16) for _ in range(2))
    wd = (torch.randn(E, H, I, device=dev) * 0.02).to(torch.bfloat16)

    def gemms():
        _, _, h = gemm.gate_up(xs, wg, wu, sched)
        gemm.grouped_mm(h, wd, sched)

    n = 470 * 1024 * 1024 // 2  # bf16 elements
    buf = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    buf.normal_()
    peer = (rank + 1) % world
    peer_view = hdl.get_buffer(peer, (n,), torch.bfloat16)
    dst = torch.empty(n, device=dev, dtype=torch.bfloat16)
    TILE = 8192  # 16 KB
    n_tiles = n // TILE

    def sm_copy(progs, hint=0, warps=4):
        _copy_kernel[(progs,)](
            peer_view, dst, n_tiles, TILE=TILE, PROGS=progs, HINT=hint, num_warps=warps
        )

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    box = [TMA_ROWS, TMA_COLS]
    src_d = TensorDescriptor(peer_view, [n // TMA_COLS, TMA_COLS], [TMA_COLS, 1], box, layout)
    dst_d = TensorDescriptor(dst, [n // TMA_COLS, TMA_COLS], [TMA_COLS, 1], box, layout)
    n_boxes = n // (TMA_ROWS * TMA_COLS)

    def tma_copy(progs):
        _tma_copy_kernel[(progs,)](
            src_d, dst_d, n_boxes, PROGS=progs, STAGES=TMA_STAGES, num_warps=1
        )

    def ce_copy():
        dst.copy_(peer_view, non_blocking=True)

    s_g, s_c = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    # compile, load and set carveouts before any concurrent launch
    gemms()
    for p in (33, 66, 132):
        for hint in (0, 1, 2):
            for warps in (2, 4):
                sm_copy(p, hint, warps)
                _carve(
                    _copy_kernel.warmup(
                        peer_view,
                        dst,
                        n_tiles,
                        TILE=TILE,
                        PROGS=p,
                        HINT=hint,
                        num_warps=warps,
                        grid=(p,),
                    )
                )
    for k in (gemm._gate_up_kernel, gemm._grouped_mm_kernel):
        for cache in k.device_caches.values():
            for entry in cache[0].values():
                _carve(entry)
    ce_copy()
    for p in (33, 66):
        dst.zero_()
        tma_copy(p)
        torch.cuda.synchronize()
        assert torch.equal(dst, peer_view), "the TMA copy lost data"

    def timed(gemm_on, copy_fn):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        dist.barrier()
        torch.cuda.synchronize()
        if gemm_on:
            with torch.cuda.stream(s_g):
                ev[0].record()
                gemms()
                ev[1].record()
        if copy_fn is not None:
            with torch.cuda.stream(s_c):
                ev[2].record()
                copy_fn()
                ev[3].record()
        torch.cuda.synchronize()
        return (
            ev[0].elapsed_time(ev[1]) if gemm_on else None,
            ev[2].elapsed_time(ev[3]) if copy_fn is not None else None,
        )

    cases = [("gemms alone", True, None)]
    for p in (33, 66, 132):
        cases += [
            (f"SM copy {p} alone", False, lambda p=p: sm_copy(p)),
            (f"gemms + SM copy {p}", True, lambda p=p: sm_copy(p)),
        ]
    for p in (33, 66):
        for hint in (1, 2):
            cases += [
                (f"SM copy {p} hint {hint}", False, lambda p=p, h=hint: sm_copy(p, h)),
                (f"gemms + SM copy {p} h{hint}", True, lambda p=p, h=hint: sm_copy(p, h)),
            ]
        cases += [
            (f"SM copy {p} 2 warps", False, lambda p=p: sm_copy(p, 0, 2)),
            (f"gemms + SM copy {p} 2w", True, lambda p=p: sm_copy(p, 0, 2)),
            (f"TMA copy {p} alone", False, lambda p=p: tma_copy(p)),
            (f"gemms + TMA copy {p}", True, lambda p=p: tma_copy(p)),
        ]
    cases += [("gemms alone (again)", True, None)]
    cases += [("CE copy alone", False, ce_copy), ("gemms + CE copy", True, ce_copy)]
    flops = 2 * 32768 * (2 * H * I + I * H)
    for name, gemm_on, copy_fn in cases:
        res = [timed(gemm_on, copy_fn) for _ in range(7)]
        parts = []
        if gemm_on:
            gms = statistics.median(r[0] for r in res)
            parts.append(f"gemms {gms:.3f} ms ({flops / gms / 1e9:.0f} TFLOP/s)")
        if copy_fn is not None:
            cms = statistics.median(r[1] for r in res)
            parts.append(f"copy {cms:.3f} ms ({2 * n / cms / 1e6:.0f} GB/s from the peer)")
        print(f"rank {rank}: {name:<26} " + ", ".join(parts), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
