"""Tile sweep of the grouped GEMMs: which tiles, stages, warps and grid are fastest, by shape.

For each shape (a model of the table, or a preset) and each of the six GEMMs, every candidate of
``CANDIDATES[precision][tile kind]`` (the default first) is compiled, its output compared
bitwise with the default's (a tile choice must never change a bit), and then the candidates are
timed round-robin (``rounds`` rounds of ``iters`` iterations each, so a drift of the GPU's clock
hits all of them alike). One record per (shape, kernel, candidate): median ms, TFLOP/s, the
ratio to the default in the same run, ``same_bits`` and the tiles. A candidate that does not
compile or does not fit the SM is recorded with its error and left out of the timing.

``python -m megamoe.tools.sweep_tiles --model dsv3 qwen3-30b glm-4.5 --precision bf16 fp8
--out tiles.json``. The chosen tiles go into ``gemm.GPU_TILES`` / ``fp8_gemm.GPU_TILES`` (or a
rule by shape) with the records that chose them (docs/tuning.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
from collections.abc import Callable, Iterator

import torch

from ..kernels import fp8_gemm, fp8_ws
from ..kernels.gemm import GemmTiles
from .bench_kernels import KERNELS, _flops, _gpu_name, event_times_ms, gemm_shapes, kernel_calls

__all__ = ["CANDIDATES", "TILE_KIND", "sweep_tiles", "fits_shared_memory"]

# The tile table entry each kernel of the bench reads (fp8's dgrad of gate/up has its own:
# ``FP8_TILE_KIND``).
TILE_KIND = {
    "gate_up": "gate_up",
    "down": "mm",
    "dgrad_swiglu": "swiglu_bwd",
    "dgrad_pair": "mm",
    "wgrad_down": "wgrad",
    "wgrad_gate_up": "wgrad",
}
FP8_TILE_KIND = {**TILE_KIND, "dgrad_pair": "pair"}

T = GemmTiles
# Candidates beside the defaults: narrower tiles, other depths, two programs per SM with
# 64-row tiles of one warpgroup (the second program's MMAs run while the first one's epilogue
# or fp8 promotion does). (Triton 3.6's warp_specialize on the tile loop leaves the sm_90a PTX
# unchanged: not a candidate.)
_BF16_ROW = [
    T(bn=128, bk=64, stages=4, warps=8),
    T(bn=128, bk=64, stages=5, warps=8),
    T(bn=128, bk=64, stages=3, warps=8),
    T(bn=128, bk=64, stages=2, warps=8, programs_per_sm=2),
    T(bn=128, bk=64, stages=3, warps=4, bm=64, programs_per_sm=2),
]
_FP8_ROW = [
    T(bn=128, bk=128, stages=4, warps=8),
    T(bn=128, bk=128, stages=3, warps=8),
    T(bn=128, bk=128, stages=2, warps=4, bm=64, programs_per_sm=3),
    T(bn=64, bk=128, stages=4, warps=4, bm=64, programs_per_sm=3),
    T(bn=128, bk=128, stages=3, warps=4, bm=64, programs_per_sm=2),
    # 128-row tiles in one warpgroup as two 64-row halves (``fp8_gemm.fp8_mm_acc_split``): the
    # 128 x 128 tile's operand bytes, promotions hidden by the other program's MMAs
    T(bn=128, bk=128, stages=3, warps=4, bm=128, programs_per_sm=2, split_m=2),
    T(bn=128, bk=128, stages=2, warps=4, bm=128, programs_per_sm=2, split_m=2),
    # the same with the halves strictly ordered (``strict_order``: the forward down's)
    T(bn=128, bk=128, stages=3, warps=4, bm=128, programs_per_sm=2, split_m=2, strict_order=True),
]
# one loop over all of a program's K steps (``flatten``) in split tiles: gate/up (3 stages spill
# 8 B), the weight gradient, the one-pair grouped mm (not "pair"; the forward down's spills
# unless strictly ordered, the SwiGLU backward's 204 B)
_FP8_FLAT = T(bm=128, bn=128, bk=128, stages=2, warps=4, programs_per_sm=2, split_m=2, flatten=True)
# the warp-specialized kernel's wide tiles (256 columns: a quarter fewer operand bytes a FLOP;
# 3 stages fill the shared memory), walked automatically and in groups of 8 row tiles
_FP8_WIDE = [
    dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, bn=256, stages=3, group_m=g) for g in (0, 8)
]
_BF16_WGRAD = [  # (the entries' defaults are each other's candidates)
    T(bm=128, bn=256, bk=64, stages=3, warps=8),
    T(bm=128, bn=128, bk=64, stages=2, warps=4, programs_per_sm=2),
    T(bm=128, bn=128, bk=64, stages=4, warps=8),
    T(bm=256, bn=128, bk=64, stages=3, warps=8),
    T(bm=128, bn=128, bk=64, stages=3, warps=8),
    T(bm=128, bn=128, bk=64, stages=2, warps=8, programs_per_sm=2),
    T(bm=128, bn=256, bk=32, stages=4, warps=8),
    # few rows per expert (K of 80-256): one K step of 128, or two or three programs
    # per SM whose loads run while another's tile is stored
    T(bm=128, bn=128, bk=128, stages=2, warps=8),
    T(bm=64, bn=128, bk=64, stages=2, warps=4, programs_per_sm=3),
    T(bm=64, bn=256, bk=64, stages=2, warps=4, programs_per_sm=2),
    # the two entries' tiles as one loop over all of a program's K steps (``flatten``)
    T(bm=128, bn=256, bk=64, stages=3, warps=8, flatten=True),
    T(bm=128, bn=128, bk=64, stages=2, warps=4, programs_per_sm=2, flatten=True),
]
CANDIDATES: dict[str, dict[str, list[GemmTiles]]] = {
    "bf16": {
        "gate_up": [
            T(bn=128, bk=64, stages=3, warps=8),
            T(bn=64, bk=64, stages=4, warps=4, bm=64, programs_per_sm=2),
            # long K (H of 4096-7168) and wide I: deeper K steps, more stages (0.49-0.93x the
            # default on Llama-4-Scout, Mixtral, Qwen2-57B and Qwen3-30B, 2026-12-02)
            T(bn=128, bk=128, stages=2, warps=8),
            T(bn=64, bk=64, stages=6, warps=8),
            T(bn=128, bk=32, stages=6, warps=8),
        ],
        "mm": _BF16_ROW,
        "swiglu_bwd": _BF16_ROW,
        "wgrad": _BF16_WGRAD,
        "wgrad_few_rows": _BF16_WGRAD,
    },
    "fp8": {
        "gate_up": [
            T(bn=64, bk=128, stages=4, warps=8),
            T(bn=64, bk=128, stages=4, warps=4, bm=64, programs_per_sm=2),
            # 128-row tiles as two 64-row halves (four 64 x 64 accumulators)
            T(bn=64, bk=128, stages=3, warps=4, bm=128, programs_per_sm=2, split_m=2),
            T(bn=64, bk=128, stages=2, warps=4, bm=128, programs_per_sm=2, split_m=2),
            # flattened (3 stages spill 8 B)
            dataclasses.replace(_FP8_FLAT, bn=64, stages=3),
            dataclasses.replace(_FP8_FLAT, bn=64),
        ]
        # the warp-specialized Gluon kernel (``fp8_ws``: 64 columns of gate and of up a tile),
        # the tiles column-fast and in groups of row tiles
        + [
            dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, bn=64, stages=n, group_m=g)
            for n, g in ((4, 0), (3, 0), (4, 1), (4, 8), (4, 16))
        ]
        # wide: 128 columns of each weight (a 256-row B slot, h staged through g's tile)
        + [dataclasses.replace(t, bn=128) for t in _FP8_WIDE],
        "mm": _FP8_ROW
        + [dataclasses.replace(_FP8_FLAT, stages=3, strict_order=True)]
        # the warp-specialized Gluon kernel (``fp8_ws``)
        + [
            dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, stages=n, group_m=g)
            for n, g in ((4, 0), (5, 0), (3, 0), (4, 1), (4, 8))
        ]
        + _FP8_WIDE,
        "pair": _FP8_ROW
        + [
            dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, stages=n, group_m=g)
            for n, g in ((4, 0), (3, 0), (4, 1), (4, 8))
        ]
        + _FP8_WIDE,
        "swiglu_bwd": _FP8_ROW
        + [_FP8_FLAT]
        + [
            dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, stages=n, group_m=g)
            for n, g in ((4, 0), (3, 0), (4, 1), (4, 8))
        ],
        "wgrad": [
            T(bm=128, bn=128, bk=128, stages=4, warps=8),
            T(bm=128, bn=64, bk=128, stages=4, warps=4, programs_per_sm=2),
            T(bm=128, bn=128, bk=128, stages=3, warps=4, programs_per_sm=2, split_m=2),
            T(bm=128, bn=128, bk=128, stages=2, warps=4, programs_per_sm=2, split_m=2),
            # one loop over all of a program's K steps, the pipeline running on across tiles
            dataclasses.replace(_FP8_FLAT, stages=3),
            _FP8_FLAT,
        ]
        + [dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, stages=n) for n in (4, 3)]
        # wide: 256 columns, four 64-column partial accumulators a consumer
        + [dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, bn=256, stages=3)],
        # fp32 outputs (the kernel picks the entry by the output dtype; the bench's weight
        # gradients are bf16, so a sweep times these only through "wgrad")
        "wgrad_fp32": [
            T(bm=64, bn=128, bk=128, stages=3, warps=4, programs_per_sm=2),
            T(bm=128, bn=128, bk=128, stages=4, warps=8),
            _FP8_FLAT,
        ],
    },
}

# Shared memory of one H100/H200 SM that thread blocks may use, and the per-block reserve.
_SM_SHARED_BYTES = 228 * 1024
_BLOCK_RESERVED_BYTES = 1024


def fits_shared_memory(tile_kind: str, t: GemmTiles, precision: str, block_rows: int = 128) -> bool:
    """An estimate of whether ``programs_per_sm`` programs of these tiles fit one SM's shared
    memory: the operand stages plus one bf16 epilogue tile (Triton reuses it for the others;
    a split tile stores one sub-tile at a time).
    A compile that does not fit fails anyway; this keeps the sweep from compiling it."""
    if t.warp_specialized:  # (fp8_ws: one CTA per SM)
        # (the weight gradient's bm 192: three consumers; 0, automatic: these tiles' two)
        wgrad_rows = t.bm if tile_kind.startswith("wgrad") else 0
        consumers = wgrad_rows // fp8_ws.HALF_ROWS.value or 2
        need = fp8_ws.smem_bytes(t.stages, kind=tile_kind, cols=t.bn, consumers=consumers)
        return need + _BLOCK_RESERVED_BYTES <= _SM_SHARED_BYTES
    a_bytes = 1 if precision == "fp8" else 2
    bm = t.bm or block_rows
    b_tiles = 2 if tile_kind == "gate_up" else 1
    stage = (bm * t.bk + b_tiles * t.bn * t.bk) * a_bytes
    per_program = t.stages * stage + bm // t.split_m * t.bn * 2 + _BLOCK_RESERVED_BYTES
    return per_program * t.programs_per_sm <= _SM_SHARED_BYTES


def _entries(module, tile_kind: str) -> list[str]:
    """The tile entries a sweep of ``tile_kind`` sets: every weight-gradient entry for a weight
    gradient (the kernel picks one by shape, ``gemm.wgrad_kind``), else the one."""
    if not tile_kind.startswith("wgrad"):
        return [tile_kind]
    return [k for k in module.GPU_TILES if k.startswith("wgrad")]


@contextlib.contextmanager
def _tiles(module, tile_kind: str, t: GemmTiles) -> Iterator[None]:
    """Within this block, ``module``'s kernels of ``tile_kind`` run with tiles ``t``."""
    old = dict(module.GPU_TILES)
    for entry in _entries(module, tile_kind):
        module.GPU_TILES[entry] = t
    try:
        yield
    finally:
        module.GPU_TILES.update(old)


def _bits(out, rows: int, used: int) -> list[torch.Tensor]:
    """Every output tensor of a call as raw bytes (NaN-safe bitwise comparison); of a row
    output (``rows`` rows) only the ``used`` rows the kernels write."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [
        (o[:used] if o.shape[0] == rows else o).contiguous().view(torch.uint8).clone() for o in outs
    ]


def _sweep_kernel(
    module,
    tile_kind: str,
    fn: Callable[[], object],
    cands: list[GemmTiles],
    iters: int,
    rounds: int,
    rows: tuple[int, int],
) -> list[dict]:
    """Records of each candidate of one kernel at one shape (the default is ``cands[0]``);
    ``rows``: (rows, written rows) of the padded row layout, for :func:`_bits`."""
    recs, live, ref = [], [], None
    for t in cands:
        rec = dict(tiles=dataclasses.asdict(t), default=not recs)
        try:
            with _tiles(module, tile_kind, t):
                bits = _bits(fn(), *rows)  # compiles; then a warm-up
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
            if ref is None:
                ref = bits
            rec["same_bits"] = len(bits) == len(ref) and all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(bits, ref)
            )
            live.append((t, rec, []))
        except Exception as exc:  # too large for the SM, or not compilable: record, go on
            rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
        recs.append(rec)
    for _ in range(rounds):
        for t, _rec, times in live:
            with _tiles(module, tile_kind, t):
                times += event_times_ms(fn, iters)
    for _t, rec, times in live:
        rec["ms"] = statistics.median(times)
    return recs


def sweep_tiles(
    models: list[str],
    tokens: int,
    precisions: tuple[str, ...],
    iters: int = 10,
    rounds: int = 3,
    kernels: tuple[str, ...] = KERNELS,
    progress: Callable[[str], None] = print,
    only: str | None = None,
) -> list[dict]:
    """The records of the module docstring at each shape of ``models`` with ``tokens`` tokens;
    ``only`` (a ``GemmTiles`` field: "split_m", "flatten", "strict_order",
    "warp_specialized" or "group_m"): of the candidates only those that set it (split_m > 1,
    group_m != 1, the others True) beside the default."""
    from ..kernels import gemm

    modules = {"bf16": gemm, "fp8": fp8_gemm}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    records = []
    for name, e, rows, h, i in gemm_shapes(models, tokens):
        try:
            calls, sched = kernel_calls(e, rows, h, i, precisions)
        except torch.OutOfMemoryError:
            # all of a model's experts on one GPU may not fit (Kimi-K2's 384 on an H100):
            # the model is skipped and said so, the others still run
            torch.cuda.empty_cache()
            progress(f"{name}: its {e} experts' operands do not fit this GPU's memory; skipped")
            records.append(dict(shape=name, tokens=tokens, experts=e, skipped="out of memory"))
            continue
        written = (sched.rows, int(sched.num_blocks.item()) * sched.block_rows)
        for precision in precisions:
            module = modules[precision]
            fns = calls["triton-fp8" if precision == "fp8" else "triton"]
            for kind in kernels:
                tile_kind = (FP8_TILE_KIND if precision == "fp8" else TILE_KIND)[kind]
                if tile_kind == "wgrad" and hasattr(module, "wgrad_kind"):
                    tile_kind = module.wgrad_kind(sched)  # the entry this shape's rule takes
                cands = [module.GPU_TILES[tile_kind]] + [
                    t
                    for t in CANDIDATES[precision][tile_kind]
                    if t != module.GPU_TILES[tile_kind]
                    and (only is None or _sets(t, only))
                    and fits_shared_memory(tile_kind, t, precision)
                ]
                recs = _sweep_kernel(module, tile_kind, fns[kind], cands, iters, rounds, written)
                base_ms = recs[0].get("ms")
                for rec in recs:
                    rec.update(
                        shape=name,
                        tokens=tokens,
                        experts=e,
                        rows_per_expert=rows,
                        hidden=h,
                        intermediate=i,
                        kernel=kind,
                        tile_kind=tile_kind,
                        precision=precision,
                        gpu=_gpu_name(),
                        date=date,
                    )
                    if "ms" in rec:
                        rec["tflops"] = _flops(kind, e * rows, h, i) / rec["ms"] / 1e9
                        if base_ms:
                            rec["vs_default"] = base_ms / rec["ms"]
                    progress(_line(rec))
                records += recs
        del calls
        torch.cuda.empty_cache()
    return records


def _sets(t: GemmTiles, field: str) -> bool:
    """Whether tiles ``t`` set ``field`` (split_m: more than one sub-tile; group_m: anything but
    single row tiles)."""
    value = getattr(t, field)
    if field == "group_m":  # (0: automatic)
        return value != 1
    return value > 1 if field == "split_m" else bool(value)


def _meta_gemms(precision: str, h: int, i: int, e: int, tokens: int, top_k: int) -> None:
    """Every grouped GEMM of one training step on meta tensors (nothing runs: launches only)."""
    from ..kernels import fp8, gemm
    from ..kernels.schedule import build_row_schedule

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    ids = torch.empty((tokens, top_k), dtype=torch.int64, device="meta")
    s = build_row_schedule(ids, e, 128)
    if precision == "bf16":
        wg, wu, wd = meta(e, i, h), meta(e, i, h), meta(e, h, i)
        g, u, hh = gemm.gate_up(meta(s.rows, h), wg, wu, s)
        gemm.grouped_mm(hh, wd, s)
        dg, du = gemm.dgrad_swiglu(meta(s.rows, h), wd, g, u, s)
        gemm.dgrad_pair(dg, wg, du, wu, s)
        gemm.wgrad(dg, meta(s.rows, h), s)
        return
    wg, wu = (fp8.quantize_weight(meta(e, i, h), transposed=True) for _ in range(2))
    wd = fp8.quantize_weight(meta(e, h, i), transposed=True)
    g, u, hh = fp8_gemm.gate_up(*fp8.quantize_rows(meta(s.rows, h)), wg, wu, s)
    fp8_gemm.grouped_mm(*fp8.quantize_rows(hh), wd, s)
    dg, du = fp8_gemm.dgrad_swiglu(*fp8.quantize_rows(meta(s.rows, h)), wd, g, u, s)
    fp8_gemm.dgrad_pair(*fp8.quantize_rows(dg), wg, *fp8.quantize_rows(du), wu, s)
    fp8_gemm.wgrad(*fp8.quantize_cols(dg), *fp8.quantize_cols(meta(s.rows, h)), s)


_KERNEL_OF_TILE_KIND = {
    "gate_up": ("_gate_up_kernel", "_fp8_gate_up_kernel", "_ws_gate_up_kernel"),
    "mm": ("_grouped_mm_kernel", "_fp8_grouped_mm_kernel", "_ws_grouped_mm_kernel"),
    "pair": ("_grouped_mm_kernel", "_fp8_grouped_mm_kernel", "_ws_grouped_mm_kernel"),
    "swiglu_bwd": ("_grouped_mm_kernel", "_fp8_grouped_mm_kernel", "_ws_grouped_mm_kernel"),
    "wgrad": ("_wgrad_kernel", "_fp8_wgrad_kernel", "_ws_wgrad_kernel"),
    "wgrad_few_rows": ("_wgrad_kernel", "_fp8_wgrad_kernel", "_ws_wgrad_kernel"),
    "wgrad_fp32": ("_wgrad_kernel", "_fp8_wgrad_kernel", "_ws_wgrad_kernel"),
}


def compile_candidates(
    precisions: tuple[str, ...], progress: Callable[[str], None] = print
) -> list[dict]:
    """Without a GPU: each candidate's kernels compiled for sm_90a (``compile_check``) at
    DeepSeek-V3's expert sizes, with their registers, spills and shared memory, so that the
    timed sweep spends no GPU time on tiles that spill or do not fit. Run with
    ``TRITON_INTERPRET`` unset."""
    from ..kernels import gemm
    from ..kernels.runtime import assume_programs
    from . import compile_check as cc

    modules = {"bf16": gemm, "fp8": fp8_gemm}
    records, seen = [], set()
    for precision in precisions:
        module = modules[precision]
        for tile_kind, cands in CANDIDATES[precision].items():
            for t in [module.GPU_TILES[tile_kind], *cands]:
                # (the weight-gradient entries share their candidates and their launches)
                key = (precision, "wgrad" if tile_kind.startswith("wgrad") else tile_kind, t)
                if key in seen:
                    continue
                seen.add(key)
                with (
                    _tiles(module, tile_kind, t),
                    assume_programs(cc.H200_SMS),
                    cc.record_launches(lambda: "") as launches,
                ):
                    _meta_gemms(precision, 7168, 2048, 32, 512, 8)
                names = _KERNEL_OF_TILE_KIND[tile_kind]
                # the launches this tile kind's entry shapes (swiglu_bwd: the SwiGLU epilogue;
                # fp8's pair: two (A, W) pairs)
                mine = [
                    launch
                    for launch in launches
                    if launch.name in names and _row_kind(launch, precision) in (None, tile_kind)
                ]
                for launch in mine:
                    rec = dict(
                        precision=precision,
                        tile_kind=tile_kind,
                        kernel=launch.name,
                        tiles=dataclasses.asdict(t),
                    )
                    try:
                        rep = cc.compile_launch(launch)
                        rec.update({k: rep[k] for k in ("registers", "spill_bytes", "shared")})
                    except Exception as exc:
                        rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
                    progress(json.dumps(rec))
                    records.append(rec)
    return records


def _row_kind(launch, precision: str) -> str | None:
    """The tile entry a grouped-mm launch read ("mm", "pair" or "swiglu_bwd"), else None."""
    names = launch.fn.arg_names
    flags = {names[k[0]] for k, v in launch.constexprs.items() if v is True}
    if "SWIGLU_BWD" in flags:
        return "swiglu_bwd"
    if "TWO_PAIRS" in flags and precision == "fp8":
        return "pair"
    return "mm" if launch.name.endswith("grouped_mm_kernel") else None


def _line(rec: dict) -> str:
    t = rec["tiles"]
    tiles = f"{t['bm'] or 'blk'}x{t['bn']}x{t['bk']} s{t['stages']}"
    if t.get("warp_specialized"):  # (its other fields are the Triton fallback's)
        tiles += " warp-specialized" + (f" g{t['group_m']}" if t.get("group_m", 1) != 1 else "")
    else:
        tiles += (
            f" w{t['warps']} p{t['programs_per_sm']}"
            + (f" split{t['split_m']}" if t.get("split_m", 1) > 1 else "")
            + (" strict" if t.get("strict_order") else "")
            + (" flat" if t.get("flatten") else "")
        )
    head = f"{rec['shape']:16s} {rec['precision']:4s} {rec['kernel']:14s} {tiles:28s}"
    if "error" in rec:
        return f"{head} ERROR {rec['error'][:90]}"
    bits = "same bits" if rec["same_bits"] else "BITS DIFFER"
    return (
        f"{head} {rec['ms']:8.3f} ms {rec['tflops']:7.1f} TFLOP/s "
        f"{rec.get('vs_default', 0):5.2f}x {bits}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tile sweep of the grouped GEMMs (one GPU)")
    parser.add_argument("--model", nargs="+", default=["dsv3", "qwen3-30b", "glm-4.5"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--precision", nargs="+", choices=["bf16", "fp8"], default=["bf16"])
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--iters", type=int, default=10, help="iterations per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the records as JSON here")
    parser.add_argument(
        "--only",
        choices=["split_m", "flatten", "strict_order", "warp_specialized", "group_m"],
        help="of the candidates time only those that set this field (split_m: > 1, group_m: != 1)",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU: compile each candidate for sm_90a and report registers, spills, shared",
    )
    args = parser.parse_args(argv)
    if args.compile_only:
        records = compile_candidates(tuple(args.precision))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
        return 0
    records = sweep_tiles(
        args.model,
        args.tokens,
        tuple(args.precision),
        args.iters,
        args.rounds,
        tuple(args.kernels),
        only=args.only,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    skipped = [r["shape"] for r in records if "skipped" in r]
    if skipped:
        print(f"skipped (out of memory): {', '.join(skipped)}")
    differ = [r for r in records if r.get("same_bits") is False]
    if differ:
        print(f"{len(differ)} candidates changed bits: a tile choice must not")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
