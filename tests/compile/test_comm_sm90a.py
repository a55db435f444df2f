"""The communication kernels lower to sm_90a code with the atomics and vector widths they rely on
(as the backends launch them: dispatch_pull's and combine_push's tiles and warps)."""

from __future__ import annotations

import re

import pytest

from support.compiled import pick


def _has(ptx: str, pattern: str) -> bool:
    return re.search(pattern, ptx) is not None


@pytest.mark.parametrize("world", [2, 8])
def test_barrier_uses_release_and_acquire_at_system_scope(compiled, world):
    (bar,) = pick(compiled, "_barrier_kernel", f"W={world}")
    ptx = bar["ptx"]
    # Signal: release exchange at system scope into the peers' pads.
    assert _has(ptx, r"atom\.global\.(sys\.release|release\.sys)\.exch\.b32"), ptx
    # Poll: acquire read-modify-write (add 0) at system scope.
    assert _has(ptx, r"atom\.global\.(sys\.acquire|acquire\.sys)\.add\.u32"), ptx
    # The CTA barrier that orders the program's earlier stores before the release.
    assert "bar.sync" in ptx
    # The watchdog's first-stall-wins record.
    assert _has(ptx, r"atom\.global\.(gpu\.relaxed|relaxed\.gpu)\.cas\.b32"), ptx


@pytest.mark.parametrize("name", ["_pull_kernel", "_pull_tokens_kernel"])
def test_pull_moves_16_byte_vectors_from_peers(compiled, name):
    for r in pick(compiled, name):
        ptx = r["ptx"]
        # Peer rows come through int64 addresses cast to pointers; without the alignment hint
        # the loads would be 2-byte scalars, far from NVLink rates.
        assert _has(ptx, r"ld\.global(\.\w+)*\.v4\.b32"), "peer loads are not vectorized"
        assert _has(ptx, r"st\.global(\.\w+)*\.v4\.b32"), "local stores are not vectorized"
        assert not _has(ptx, r"ld\.global(\.\w+)*\.b16\b"), "scalar 2-byte loads left"


def test_push_moves_16_byte_vectors_to_peers(compiled):
    for r in pick(compiled, "_push_kernel"):
        ptx = r["ptx"]
        assert _has(ptx, r"st\.global(\.\w+)*\.v4\.b32"), "peer stores are not vectorized"
        assert _has(ptx, r"ld\.global(\.\w+)*\.v4\.b32")
        assert not _has(ptx, r"st\.global(\.\w+)*\.b16\b"), "scalar 2-byte stores left"


def test_copies_use_no_shared_memory_pipeline(compiled):
    # Copies keep their bytes in registers (a few hundred bytes of shared memory for layout
    # conversions of the row metadata): nothing competes with the GEMM tiles' shared memory.
    for name in ("_pull_kernel", "_pull_tokens_kernel", "_push_kernel"):
        for r in pick(compiled, name):
            assert r["shared"] <= 1024, (name, r["shared"])
