"""Compile every kernel for Hopper (sm_90a) on any machine, no GPU needed.

``triton.compile`` runs the whole pipeline including ptxas, so this proves on the CPU that the
kernels still lower, use wgmma and TMA where they should, and fit in shared memory. Must run
with ``TRITON_INTERPRET`` unset (under the interpreter ``@triton.jit`` gives interpreted
functions): the CPU test calls ``python -m megamoe.kernels.compile_check --json`` in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile

from ..backends import triton as ep
from . import gemm, rows, schedule

__all__ = ["KernelSpec", "kernel_specs", "compile_spec", "HOPPER", "SMEM_LIMIT"]

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one H100/H200 block may use
_BLOCK_ROWS = 128  # the default config.block_rows


@dataclass(frozen=True)
class KernelSpec:
    name: str
    fn: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int
    is_gemm: bool  # must use wgmma and TMA


def _desc(shape: list[int]) -> str:
    return f"tensordesc<bf16[{', '.join(map(str, shape))}]>"


def _sig(fn, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types[name]
    return sig


def _spec(name, fn, types, constexprs, warps=4, stages=3, is_gemm=False) -> KernelSpec:
    return KernelSpec(name, fn, _sig(fn, types, constexprs), constexprs, warps, stages, is_gemm)


def kernel_specs() -> list[KernelSpec]:
    """One spec per kernel variant the backend launches on a GPU (dsv3-like sizes)."""
    bm = _BLOCK_ROWS
    specs = []
    e, e_pad = 32, 32
    chunk = schedule._chunk(e_pad)
    specs.append(_spec("histogram", schedule._histogram_kernel,
                       dict(ids_ptr="*i64", n_entries="i32", expert_lo="i32",
                            chunk_counts_ptr="*i32"),
                       dict(E=e, E_PAD=e_pad, CHUNK=chunk)))
    specs.append(_spec("scan", schedule._scan_kernel,
                       {**{n: "*i32" for n in ("chunk_counts_ptr", "chunk_base_ptr", "counts_ptr",
                                               "row_start_ptr", "block_expert_ptr",
                                               "num_blocks_ptr", "row_src_ptr")},
                        "n_chunks": "i32", "max_blocks": "i32"},
                       dict(E=e, E_PAD=e_pad, CHUNKS_PER_STEP=256, BLOCK_ROWS=bm,
                            SCAN_BLOCKS=schedule._SCAN_BLOCKS, PAD_STEP=schedule._PAD_STEP)))
    specs.append(_spec("place", schedule._place_kernel,
                       dict(ids_ptr="*i64", n_entries="i32", expert_lo="i32", slot_offset="i32",
                            chunk_base_ptr="*i32", row_start_ptr="*i32", dest_row_ptr="*i32",
                            row_src_ptr="*i32"),
                       dict(E=e, E_PAD=e_pad, CHUNK=chunk)))
    row_consts = dict(TOP_K=8, BLOCK_ROWS=bm, ROWS=rows._ROWS, COLS=rows._COLS, UPCAST=False)
    specs.append(_spec("gather", rows._gather_kernel,
                       dict(x_ptr="*bf16", out_ptr="*bf16", row_src_ptr="*i32",
                            num_blocks_ptr="*i32", H="i32"), row_consts))
    specs.append(_spec("route_grad", rows._route_grad_kernel,
                       dict(dy_ptr="*bf16", z_ptr="*bf16", w_ptr="*fp32", row_src_ptr="*i32",
                            num_blocks_ptr="*i32", dz_ptr="*bf16", dw_ptr="*fp32", H="i32"),
                       {**row_consts, "BY_ROW": False}))
    combine_types = dict(z_ptr="*bf16", dest_row_ptr="*i32", w_ptr="*fp32", base_ptr="*bf16",
                         invalid_ptr="*i32", out_ptr="*bf16", T="i32", H="i32")
    combine_consts = dict(TOP_K=8, HAS_WEIGHT=True, HAS_BASE=True, TOKENS=rows._TOKENS,
                          COLS=rows._COLS, UPCAST=False)
    specs.append(_spec("combine", rows._combine_kernel, combine_types,
                       {**combine_consts, "IDENTITY": False, "HAS_INVALID": False}))
    # The expert-parallel epilogue (combine_slots): slot-indexed, NaN when the step overflowed.
    specs.append(_spec("combine_slots", rows._combine_kernel, combine_types,
                       {**combine_consts, "IDENTITY": True, "HAS_INVALID": True}))
    # The EP capacity check (one program; dsv3 at W = 8: 32 local experts).
    specs.append(_spec("capacity", ep._capacity_kernel,
                       {**{n: "i32" for n in ("n_entries", "experts_per_rank", "capacity",
                                              "cap_rows", "rank")},
                        **{n: "*i32" for n in ("ids_ptr", "num_blocks_ptr", "row_start_ptr",
                                               "record_ptr", "invalid_ptr")}},
                       dict(W=8, W_PAD=8, E=e, E1_PAD=2 * e_pad, BLOCK_ROWS=bm,
                            BLOCK=ep._LOAD_BLOCK)))
    t = gemm.GPU_TILES["gate_up"]
    specs.append(_spec(
        "gate_up", gemm._gate_up_kernel,
        dict(a_desc=_desc([bm, t.bk]), bg_desc=_desc([t.bn, t.bk]), bu_desc=_desc([t.bn, t.bk]),
             g_desc=_desc([bm, t.bn]), u_desc=_desc([bm, t.bn]), h_desc=_desc([bm, t.bn]),
             block_expert_ptr="*i32", num_blocks_ptr="*i32", N="i32", K="i32"),
        dict(BM=bm, BN=t.bn, BK=t.bk, NUM_PROGS=132, FLATTEN=t.flatten, UPCAST=False),
        t.warps, t.stages, True))
    for kind, b_kn, two, swiglu_bwd in (("mm", False, False, False),
                                        ("swiglu_bwd", True, False, True),
                                        ("mm", True, True, False)):
        t = gemm.GPU_TILES[kind]
        b_block = [t.bk, t.bn] if b_kn else [t.bn, t.bk]
        types = dict(a_desc=_desc([bm, t.bk]), b_desc=_desc(b_block), a2_desc=_desc([bm, t.bk]),
                     b2_desc=_desc(b_block), c_desc=_desc([bm, t.bn]), c2_desc=_desc([bm, t.bn]),
                     g_desc=_desc([bm, t.bn]), u_desc=_desc([bm, t.bn]),
                     block_expert_ptr="*i32", num_blocks_ptr="*i32", N="i32", K="i32")
        name = "down" if not b_kn else ("dgrad_swiglu" if swiglu_bwd else "dgrad_pair")
        specs.append(_spec(name, gemm._grouped_mm_kernel, types,
                           dict(BM=bm, BN=t.bn, BK=t.bk, B_KN=b_kn, TWO_PAIRS=two,
                                SWIGLU_BWD=swiglu_bwd, NUM_PROGS=132, FLATTEN=t.flatten,
                                UPCAST=False),
                           t.warps, t.stages, True))
    t = gemm.GPU_TILES["wgrad"]
    specs.append(_spec(
        "wgrad", gemm._wgrad_kernel,
        dict(a_desc=_desc([t.bk, t.bm]), b_desc=_desc([t.bk, t.bn]),
             c_desc=_desc([1, t.bm, t.bn]), row_start_ptr="*i32", E="i32", M="i32", N="i32"),
        dict(BM=t.bm, BN=t.bn, BK=t.bk, NUM_PROGS=132, UPCAST=False), t.warps, t.stages, True))
    return specs


def compile_spec(spec: KernelSpec) -> dict:
    """Compile one kernel for sm_90a; report what the tests check."""
    src = ASTSource(spec.fn, spec.signature, constexprs=spec.constexprs)
    kernel = triton_compile(src, target=HOPPER,
                            options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    ptx = kernel.asm["ptx"]
    return dict(name=spec.name, is_gemm=spec.is_gemm, shared=kernel.metadata.shared,
                wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
                target_sm90a=".target sm_90a" in ptx, num_warps=spec.num_warps,
                spills="ld.local" in ptx)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    args = parser.parse_args(argv)
    results = [compile_spec(s) for s in kernel_specs()]
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(f"{r['name']:14s} smem={r['shared']:7d} wgmma={r['wgmma']} tma={r['tma']} "
                  f"sm90a={r['target_sm90a']} local_mem={r['spills']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
