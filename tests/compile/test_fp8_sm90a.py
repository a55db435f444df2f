"""The FP8 quantization kernels and block-scaled grouped GEMMs compile for Hopper (sm_90a).

Their launchers run on meta tensors at DeepSeek-V3's expert sizes (H 7168, I 2048, 32 experts,
128-row blocks) under ``compile_check.record_launches``, and each distinct launch is compiled
with the GPU tile choices (``fp8_gemm.GPU_TILES``: split 128-row tiles, 4 warps, two programs
per SM), and with the sweep's whole 64-row candidates, in a subprocess without the
interpreter (the flattened candidates: ``test_flattened_sm90a.py``). Checked: sm_90a PTX,
shared memory <= 227 KB, fp8 wgmma (e4m3 operands) and TMA in the GEMMs, the saturating
hardware conversion in the quantizers, the route grad's packed-rows variant (the fp8 dy) and
the one that quantizes d_z, the programs that share an SM within its registers and shared
memory, no spills and no local memory, and that the host launcher's source of each can be
generated (a kernel can compile without one: Triton 3.6's takes no tensor descriptor inside a
tuple argument).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from support import background  # noqa: E402
from support.compiled import (  # noqa: E402
    MAX_REGISTERS_PER_THREAD,
    REGISTERS_PER_SM,
    SM_SHARED,
    SMEM_LIMIT,
)

# Run in a subprocess with the interpreter off; prints one JSON list of compile reports.
SCRIPT = """
import dataclasses, json, re, torch
from megamoe.kernels import adamw, fp8, fp8_gemm, rows
from megamoe.kernels.runtime import assume_programs
from megamoe.kernels.schedule import build_row_schedule
from megamoe.tools import sweep_tiles
from megamoe.tools.compile_check import H200_SMS, compile_launch, record_launches

def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")

def step(h, i, e, tokens, top_k, block_rows):
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device="meta")
    s = build_row_schedule(ids, e, block_rows)
    w_gate = fp8.quantize_weight(meta(e, i, h), transposed=True)
    w_up = fp8.quantize_weight(meta(e, i, h), transposed=True)
    w_down = fp8.quantize_weight(meta(e, h, i), transposed=True)
    fp8.quantize_weight(meta(e, h, i))
    fp8.quantize_weight(meta(e, h, i), transposed=True, plain=False)
    g, u, hh = fp8_gemm.gate_up(*fp8.quantize_rows(meta(s.rows, h)), w_gate, w_up, s)
    fp8_gemm.gate_up_quantized(*fp8.quantize_rows(meta(s.rows, h)), w_gate, w_up, s)
    fp8_gemm.grouped_mm(*fp8.quantize_rows(hh), w_down, s)
    dg, du = fp8_gemm.dgrad_swiglu(*fp8.quantize_rows(meta(s.rows, h)), w_down, g, u, s)
    fp8_gemm.EPILOGUE_QUANTIZES["dgdu"] = True  # (a tunable, off by default)
    fp8_gemm.dgrad_swiglu_quantized(*fp8.quantize_rows(meta(s.rows, h)), w_down, g, u, s)
    fp8_gemm.EPILOGUE_QUANTIZES["dgdu"] = False
    fp8_gemm.dgrad_pair(*fp8.quantize_rows(dg), w_gate, *fp8.quantize_rows(du), w_up, s)
    fp8_gemm.wgrad(*fp8.quantize_cols(dg), *fp8.quantize_cols(meta(s.rows, h)), s)
    fp8_gemm.wgrad(*fp8.quantize_cols(meta(s.rows, h)), *fp8.quantize_cols(hh), s,
                   out_dtype=torch.float32)
    fp8.quantize_rows_cols(meta(s.rows, h), pad_to=16)  # d_z for its dgrad and wgrad
    # the passes over a routed layout's used rows only
    used = fp8_gemm.used_rows(s, s.rows)
    fp8.quantize_rows_cols(meta(s.rows, h), pad_to=16, used=used)
    fp8.requantize_cols(*fp8.quantize_rows(meta(s.rows, h)), used=used)
    # the route grad on dy's packed rows: pulled (by row, W > 1) and by token (W = 1)
    z, w = meta(s.rows, h), meta(tokens * top_k, dtype=torch.float32)
    rows.route_grad_rows(meta(s.rows, fp8.packed_width(h), dtype=torch.int16), z, w, s)
    rows.route_grad(meta(tokens, fp8.packed_width(h), dtype=torch.int16), z, w, s)
    # the same writing d_z's two quantizations (the fp8 backward's)
    rows.route_grad_rows(meta(s.rows, fp8.packed_width(h), dtype=torch.int16), z, w, s,
                         quantize=True)
    rows.route_grad(meta(tokens, fp8.packed_width(h), dtype=torch.int16), z, w, s,
                    quantize=True)
    # the optimizer's update: gate's view of a stacked weight (writing its copies), and plain
    hyper = adamw.AdamWStep(1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
    stacked = [meta(e, 2 * i, h) for _ in range(4)]
    adamw.adamw_quantize_(*(t[:, :i] for t in stacked), hyper)
    # its other form: 16-row parts in a loop, 8 warps, the new block read back
    old = adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD
    adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD = 16, 8, True
    adamw.adamw_quantize_(*(t[:, :i] for t in stacked), hyper)
    adamw._BLOCK_ROWS, adamw._BLOCK_WARPS, adamw._BLOCK_REREAD = old
    # fp32 weights (their transposed copies stored by address)
    fp8.quantize_weight(meta(e, h, i, dtype=torch.float32), transposed=True)
    adamw.adamw_quantize_(*(meta(e, i, h, dtype=torch.float32) for _ in range(4)), hyper)
    adamw.adamw_(*(meta(e * h * i, dtype=torch.float32) for _ in range(4)), hyper)

def unsplit(tiles):  # the sweep's first one-warpgroup candidates with whole tiles (split_m 1)
    first = lambda kind: next(t for t in sweep_tiles.CANDIDATES["fp8"][kind]
                              if t.split_m == 1 and t.warps == 4 and t.programs_per_sm == 2)
    return {**tiles, **{kind: first(kind) for kind in ("gate_up", "mm", "pair", "swiglu_bwd",
                                                        "wgrad")}}

label = ["?"]
with assume_programs(H200_SMS), record_launches(lambda: label[0]) as launches:
    label[0] = "dsv3"
    step(7168, 2048, 32, 512, 8, 128)
    label[0] = "gpt-oss (partial K blocks)"
    step(2880, 2880, 32, 512, 4, 128)
    default_tiles = dict(fp8_gemm.GPU_TILES)
    label[0] = "dsv3, the Triton kernels of the warp-specialized tiles (fp8_gemm.triton_tiles)"
    for kind, t in default_tiles.items():
        if t.warp_specialized:
            fp8_gemm.GPU_TILES[kind] = dataclasses.replace(fp8_gemm.triton_tiles(kind, t),
                                                           warp_specialized=False)
    step(7168, 2048, 32, 512, 8, 128)
    label[0] = "dsv3, narrow warp-specialized gate/up, forward down and pair, weight gradients"
    fp8_gemm.GPU_TILES.update(default_tiles)
    fp8_gemm.GPU_TILES["gate_up"] = dataclasses.replace(fp8_gemm.WARP_SPECIALIZED, bn=64)
    fp8_gemm.GPU_TILES["mm"] = fp8_gemm.GPU_TILES["pair"] = fp8_gemm.WARP_SPECIALIZED
    fp8_gemm.GPU_TILES["wgrad"] = fp8_gemm.GPU_TILES["wgrad_fp32"] = fp8_gemm.WARP_SPECIALIZED
    step(7168, 2048, 32, 512, 8, 128)
    label[0] = "dsv3, whole 64-row tiles"
    fp8_gemm.GPU_TILES.update(unsplit(default_tiles))
    step(7168, 2048, 32, 512, 8, 128)
    fp8_gemm.GPU_TILES.update(default_tiles)
reports = []
for launch in launches:
    fp8_kernel = launch.fn.fn.__module__ in (
        "megamoe.kernels.fp8", "megamoe.kernels.fp8_gemm", "megamoe.kernels.fp8_ws",
        "megamoe.kernels.adamw")
    if not fp8_kernel and not launch.fn.fn.__name__.startswith("_route_grad"):
        continue  # the row schedule's kernels (tests/compile/test_kernels_sm90a.py)
    r = compile_launch(launch, keep_ptx=True)
    ptx = r.pop("ptx")
    mmas = re.findall(r"wgmma\\.mma_async[^;]*;", ptx)
    shapes = (re.search(r"\\.(m64n\\d+k32)\\.f32\\.e4m3\\.e4m3 ", m) for m in mmas)
    r["wgmma_e4m3"] = sorted({s.group(1) for s in shapes if s})
    r["wgmma_smem_operands"] = all(re.search(r"\\}, %rd\\d+, %rd\\d+,", m) for m in mmas)
    r["cvt_satfinite"] = "cvt.rn.satfinite.e4m3x2.f32" in ptx
    names = launch.fn.arg_names
    r["variant"] = {names[k[0]]: v for k, v in launch.constexprs.items()
                    if names[k[0]] in ("BM", "BN", "TWO_PAIRS", "SWIGLU_BWD", "TRANSPOSED",
                                       "PACKED", "BY_ROW", "SPLIT_M", "QUANT_H", "QUANT",
                                           "BOUNDED", "REREAD")}
    progs = [v for k, v in launch.constexprs.items() if names[k[0]] == "NUM_PROGS"]
    r["per_sm"] = -(-progs[0] // H200_SMS) if progs else 1  # programs sharing one SM
    reports.append(r)
print(json.dumps(reports))
"""

QUANTIZERS = (
    "_quantize_rows_kernel",
    "_quantize_cols_kernel",
    "_quantize_rows_cols_kernel",
    "_quantize_weight_kernel",
    "_route_grad_fp8_kernel",
    "_adamw_fp8_kernel",  # (the optimizer's update writing the weights' copies)
)
OPTIMIZER = "_adamw_kernel"
WARP_SPECIALIZED = ("_ws_gate_up_kernel", "_ws_grouped_mm_kernel", "_ws_wgrad_kernel")  # fp8_ws
GEMMS = ("_fp8_gate_up_kernel", "_fp8_grouped_mm_kernel", "_fp8_wgrad_kernel", *WARP_SPECIALIZED)
ROUTE_GRAD = "_route_grad_kernel"  # its packed-rows variant (the fp8 backward's dy)
# the route grad that writes d_z quantized (a quantizer) and its dw sum
ROUTE_GRAD_FP8 = ("_route_grad_fp8_kernel", "_route_grad_dw_kernel")


background.define("reports", ["-c", SCRIPT], timeout=1200)  # (started at collection's end)


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    out = background.stdout("reports")
    return json.loads(out.strip().splitlines()[-1])


def _what(r: dict) -> str:
    return f"{r['name']} {r['variant']} ({r['scenario']})"


def test_every_fp8_kernel_compiles_for_sm90a(reports: list[dict]) -> None:
    assert {r["name"] for r in reports} == {
        *QUANTIZERS,
        *GEMMS,
        ROUTE_GRAD,
        *ROUTE_GRAD_FP8,
        OPTIMIZER,
    }
    for name in (ROUTE_GRAD, *ROUTE_GRAD_FP8):
        variants = [r["variant"] for r in reports if r["name"] == name]
        assert {v["BY_ROW"] for v in variants} == {False, True}, (name, variants)
        assert all(v.get("PACKED", True) for v in variants), (name, variants)
    for r in reports:
        assert r["target_sm90a"], f"{_what(r)}: PTX is not for sm_90a"
        assert 0 <= r["shared"] <= SMEM_LIMIT, f"{_what(r)}: {r['shared']} B of shared memory"
        assert not r["ptx_local"], f"{_what(r)}: local memory in the PTX"
        assert not r["launcher_error"], f"{_what(r)}: no host launcher: {r['launcher_error']}"


def test_gemms_use_fp8_wgmma_and_tma(reports: list[dict]) -> None:
    for r in reports:
        if r["name"] in GEMMS:
            assert r["wgmma_e4m3"], f"{_what(r)}: no e4m3 wgmma.mma_async in the PTX"
            # both operands K-major in shared memory: no transpose through registers
            assert r["wgmma_smem_operands"], f"{_what(r)}: a wgmma operand in registers"
            assert r["tma"], f"{_what(r)}: no cp.async.bulk.tensor (TMA)"


def test_quantizers_use_the_saturating_conversion(reports: list[dict]) -> None:
    for r in reports:
        if r["name"] in QUANTIZERS:
            assert r["cvt_satfinite"], f"{_what(r)}: no cvt.rn.satfinite.e4m3x2.f32"
    rereads = {r["variant"]["REREAD"] for r in reports if r["name"] == "_adamw_fp8_kernel"}
    assert rereads == {False, True}, rereads  # (the update's two forms)
    # the passes over a routed layout compile bounded by its used rows and unbounded
    for name in ("_quantize_cols_kernel", "_quantize_rows_cols_kernel"):
        bounded = {r["variant"]["BOUNDED"] for r in reports if r["name"] == name}
        assert bounded == {False, True}, (name, bounded)


def test_gate_up_quantizes_h_in_its_epilogue(reports: list[dict]) -> None:
    """``fp8_gemm.gate_up_quantized`` (the layer's forward) on the warp-specialized wide tiles
    compiles the variant of ``_ws_gate_up_kernel`` that quantizes h with the saturating
    conversion (its wgmma and spills are checked with the other GEMMs')."""
    variants = [r for r in reports if r["name"] == "_ws_gate_up_kernel"]
    assert {r["variant"]["QUANT_H"] for r in variants} == {False, True}
    for r in variants:
        assert r["cvt_satfinite"] == r["variant"]["QUANT_H"], _what(r)


def test_swiglu_backward_quantizes_dg_du_in_its_epilogue(reports: list[dict]) -> None:
    """``fp8_gemm.dgrad_swiglu_quantized`` (the layer's backward) on the warp-specialized
    kernel compiles the variant of ``_ws_grouped_mm_kernel`` that quantizes d_g and d_u with
    the saturating conversion; the other variants (the forward down, the dgrad of gate/up,
    the SwiGLU backward into bf16) convert nothing to fp8."""
    variants = [r for r in reports if r["name"] == "_ws_grouped_mm_kernel"]
    assert {r["variant"]["QUANT"] for r in variants} == {False, True}
    for r in variants:
        assert r["cvt_satfinite"] == r["variant"]["QUANT"], _what(r)
        assert r["variant"]["SWIGLU_BWD"] or not r["variant"]["QUANT"], _what(r)


def test_the_programs_of_one_sm_fit_without_spills(reports: list[dict]) -> None:
    """The persistent grids put ``programs_per_sm`` programs on each SM: their registers and
    shared memory must fit one SM together, or the second program runs after the first."""
    for r in reports:
        threads = r["num_warps"] * 32 * r["per_sm"]
        assert r["registers"] <= MAX_REGISTERS_PER_THREAD, _what(r)
        assert r["registers"] * threads <= REGISTERS_PER_SM, (_what(r), r["per_sm"])
        assert (r["shared"] + 1024) * r["per_sm"] <= SM_SHARED, (_what(r), r["per_sm"])
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, (_what(r), r["spill_bytes"])
