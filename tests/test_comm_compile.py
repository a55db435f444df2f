"""The communication kernels lower to real sm_90a code on the CPU, with the atomics they rely on.

Compiles in a subprocess without TRITON_INTERPRET (the interpreter replaces ``triton.jit``), the
way a launch on an H200 would specialize them: 16-byte aligned pointers, H divisible by 16.
"""

from __future__ import annotations

import json
import re

import pytest

from helpers import run_without_interpreter

_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megamoe.kernels import comm

ALIGNED = [["tt.divisibility", 16]]

def build(fn, sig, consts, aligned, warps):
    src = ASTSource(fn, signature=sig, constexprs=consts,
                    attrs={(i,): ALIGNED for i in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return {"ptx": k.asm["ptx"], "shared": k.metadata.shared}

out = {}
bar_sig = {"signal_table": "*i64", "epoch_ptr": "*i32", "err_ptr": "*i32", "channel": "i32",
           "rank": "i32", "budget": "i32", "W": "constexpr", "W_PAD": "constexpr",
           "PHASE": "constexpr"}
for w in (2, 8):
    out[f"barrier_w{w}"] = build(comm._barrier_kernel, bar_sig,
                                 {"W": w, "W_PAD": w, "PHASE": comm.BOTH}, [0, 1, 2], 1)
rows, cols = comm.copy_tile(7168, 2)
pull_sig = {"src_table": "*i64", "scale_table": "*i64", "dst_ptr": "*bf16", "row_src_ptr": "*i32",
            "num_blocks_ptr": "*i32", "T": "i32", "H": "i32", "TOP_K": "constexpr",
            "BLOCK_ROWS": "constexpr", "SCALE": "constexpr", "ROWS": "constexpr",
            "COLS": "constexpr", "UPCAST": "constexpr"}
pull_rows, pull_cols = comm.copy_tile(7168, 2, comm.PULL_TILE_BYTES)  # dispatch_pull's defaults
for scale in (False, True):
    out[f"pull_scale{int(scale)}"] = build(
        comm._pull_kernel, pull_sig, {"TOP_K": 8, "BLOCK_ROWS": 128, "SCALE": scale,
                                      "ROWS": pull_rows, "COLS": pull_cols, "UPCAST": False},
        [0, 1, 2, 3, 4, 5, 6], comm.PULL_WARPS)
tok_sig = {"src_table": "*i64", "dst_ptr": "*bf16", "dest_row_ptr": "*i32", "row_src_ptr": "*i32",
           "num_blocks_ptr": "*i32", "W": "i32", "T": "i32", "H": "i32", "TOP_K": "constexpr",
           "BLOCK_ROWS": "constexpr", "ROWS": "constexpr", "COLS": "constexpr"}
out["pull_tokens"] = build(comm._pull_tokens_kernel, tok_sig,
                           {"TOP_K": 8, "BLOCK_ROWS": 128, "ROWS": pull_rows, "COLS": pull_cols},
                           [0, 1, 2, 3, 4, 7], comm.PULL_WARPS)
push_sig = {"src_ptr": "*bf16", "dst_table": "*i64", "row_src_ptr": "*i32", "num_blocks_ptr": "*i32",
            "T": "i32", "H": "i32", "TOP_K": "constexpr", "BLOCK_ROWS": "constexpr",
            "ROWS": "constexpr", "COLS": "constexpr"}
out["push"] = build(comm._push_kernel, push_sig, {"TOP_K": 8, "BLOCK_ROWS": 128, "ROWS": rows,
                                                  "COLS": cols}, [0, 1, 2, 3, 4, 5], comm.COPY_WARPS)
val_sig = {"src_ptr": "*fp32", "dst_table": "*i64", "row_src_ptr": "*i32", "num_blocks_ptr": "*i32",
           "T": "i32", "TOP_K": "constexpr", "BLOCK_ROWS": "constexpr", "BLOCK": "constexpr"}
out["push_values"] = build(comm._push_values_kernel, val_sig,
                           {"TOP_K": 8, "BLOCK_ROWS": 128, "BLOCK": 1024}, [0, 1, 2, 3, 4], 4)
rt_sig = {"ids_table": "*i64", "weights_table": "*i64", "ids_out": "*i32", "weights_out": "*fp32",
          "TK": "i32", "BLOCK": "constexpr"}
out["gather_routing"] = build(comm._gather_routing_kernel, rt_sig, {"BLOCK": 1024}, [0, 1, 2, 3, 4], 4)
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("sm90") / "ptx.json"
    run_without_interpreter(["-c", _SCRIPT, str(path)])
    return json.loads(path.read_text())


def _has(ptx: str, pattern: str) -> bool:
    return re.search(pattern, ptx) is not None


def test_every_kernel_targets_sm90a_without_multicast(compiled):
    for name, art in compiled.items():
        assert ".target sm_90a" in art["ptx"], name
        assert "multimem" not in art["ptx"] and "multicast" not in art["ptx"], name


@pytest.mark.parametrize("world", [2, 8])
def test_barrier_uses_release_and_acquire_at_system_scope(compiled, world):
    ptx = compiled[f"barrier_w{world}"]["ptx"]
    # Signal: release exchange at system scope into the peers' pads.
    assert _has(ptx, r"atom\.global\.(sys\.release|release\.sys)\.exch\.b32"), ptx
    # Poll: acquire read-modify-write (add 0) at system scope.
    assert _has(ptx, r"atom\.global\.(sys\.acquire|acquire\.sys)\.add\.u32"), ptx
    # The CTA barrier that orders the program's earlier stores before the release.
    assert "bar.sync" in ptx
    # The watchdog's first-stall-wins record.
    assert _has(ptx, r"atom\.global\.(gpu\.relaxed|relaxed\.gpu)\.cas\.b32"), ptx


@pytest.mark.parametrize("name", ["pull_scale0", "pull_scale1", "pull_tokens"])
def test_pull_moves_16_byte_vectors_from_peers(compiled, name):
    ptx = compiled[name]["ptx"]
    # Peer rows come through int64 addresses cast to pointers; without the alignment hint the
    # loads would be 2-byte scalars, far from NVLink rates.
    assert _has(ptx, r"ld\.global(\.\w+)*\.v4\.b32"), "peer loads are not vectorized"
    assert _has(ptx, r"st\.global(\.\w+)*\.v4\.b32"), "local stores are not vectorized"
    assert not _has(ptx, r"ld\.global(\.\w+)*\.b16\b"), "scalar 2-byte loads left"


def test_push_moves_16_byte_vectors_to_peers(compiled):
    ptx = compiled["push"]["ptx"]
    assert _has(ptx, r"st\.global(\.\w+)*\.v4\.b32"), "peer stores are not vectorized"
    assert _has(ptx, r"ld\.global(\.\w+)*\.v4\.b32")
    assert not _has(ptx, r"st\.global(\.\w+)*\.b16\b"), "scalar 2-byte stores left"


def test_copies_use_no_shared_memory_pipeline(compiled):
    # Copies keep their bytes in registers (a few hundred bytes of shared memory for layout
    # conversions of the row metadata): nothing competes with the GEMM tiles' shared memory.
    for name in ("pull_scale0", "pull_scale1", "pull_tokens", "push"):
        assert compiled[name]["shared"] <= 1024, (name, compiled[name]["shared"])
