"""The tile sweep's candidates and its bitwise comparison (the timing itself needs a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megamoe.kernels import fp8_gemm, gemm  # noqa: E402
from megamoe.kernels.gemm import GemmTiles, row_tile  # noqa: E402
from megamoe.kernels.schedule import RowSchedule  # noqa: E402
from megamoe.tools import sweep_tiles  # noqa: E402
from megamoe.tools.bench_kernels import KERNELS  # noqa: E402

MODULES = {"bf16": gemm, "fp8": fp8_gemm}


def test_every_kernel_has_a_tile_kind_with_candidates() -> None:
    assert set(sweep_tiles.TILE_KIND) == set(sweep_tiles.FP8_TILE_KIND) == set(KERNELS)
    for precision, module in MODULES.items():
        assert set(sweep_tiles.CANDIDATES[precision]) == set(module.GPU_TILES)
        # the kernels' entries, plus the ones a rule picks in their place (bf16: by the rows
        # per expert; fp8: by the weight gradient's output dtype)
        kinds = sweep_tiles.FP8_TILE_KIND if module is fp8_gemm else sweep_tiles.TILE_KIND
        by_rule = set(module.GPU_TILES) - set(kinds.values())
        assert by_rule == ({"wgrad_few_rows"} if module is gemm else {"wgrad_fp32"})


@pytest.mark.parametrize("precision", sorted(MODULES))
def test_candidates_are_valid_tiles(precision: str) -> None:
    """Each candidate (and default) splits a 128-row block into whole tiles, keeps the fp8 K
    step at the scale block, and fits one SM's shared memory with its programs."""
    defaults = MODULES[precision].GPU_TILES
    for kind, cands in sweep_tiles.CANDIDATES[precision].items():
        for t in [defaults[kind], *cands]:
            if not kind.startswith("wgrad"):
                bm, per_block = row_tile(t, 128)
                assert bm * per_block == 128
            else:  # (fp8's warp-specialized one may leave it to fp8_ws.wgrad_tiles: 0)
                automatic = precision == "fp8" and t.warp_specialized and t.bm == 0
                assert t.bm > 0 or automatic, f"{kind} {t}: the weight gradient needs a height"
            if precision == "fp8":
                assert t.bk == 128, f"{kind} {t}: the fp8 K step is the scale block"
            assert t.programs_per_sm >= 1
            assert sweep_tiles.fits_shared_memory(kind, t, precision), (kind, t)


def test_fits_shared_memory_counts_stages_and_programs() -> None:
    big = GemmTiles(bn=256, bk=128, stages=6, warps=8)
    assert not sweep_tiles.fits_shared_memory("mm", big, "bf16")
    one = GemmTiles(bn=128, bk=64, stages=3, warps=4, bm=64)
    assert sweep_tiles.fits_shared_memory("mm", one, "bf16")
    four = GemmTiles(bn=128, bk=64, stages=3, warps=4, bm=64, programs_per_sm=4)
    assert not sweep_tiles.fits_shared_memory("mm", four, "bf16")


def test_row_tile_rejects_a_height_that_splits_an_expert() -> None:
    with pytest.raises(ValueError, match="bm = 48 must divide block_rows = 128"):
        row_tile(GemmTiles(bn=64, bk=64, stages=3, warps=4, bm=48), 128)


def test_bits_compare_only_the_rows_the_kernels_write() -> None:
    """Rows past the schedule's used ones hold whatever the allocator left: the comparison of
    a candidate with the default must not see them, and must see every written bit (NaN too)."""
    a = torch.zeros(8, 4, dtype=torch.bfloat16)
    b = a.clone()
    b[6:] = 1.0  # garbage past the 6 used rows
    dw = torch.full((2, 4, 4), float("nan"), dtype=torch.bfloat16)  # not a row output
    ref, got = sweep_tiles._bits((a, dw), 8, 6), sweep_tiles._bits((b, dw.clone()), 8, 6)
    assert all(torch.equal(x, y) for x, y in zip(ref, got))
    b[5, 0] = -0.0  # one written bit differs (== would call it equal)
    assert not torch.equal(sweep_tiles._bits(b, 8, 6)[0], ref[0])


def test_lines_name_tiles_and_errors() -> None:
    split = GemmTiles(bm=128, bn=128, bk=128, stages=3, warps=4, programs_per_sm=2, split_m=2)
    strict = dataclasses.replace(split, strict_order=True)
    base = dict(shape="dsv3", precision="fp8", kernel="down", tiles=dataclasses.asdict(strict))
    ok = sweep_tiles._line(dict(base, ms=1.25, tflops=700.0, vs_default=1.07, same_bits=True))
    assert "128x128x128 s3 w4 p2 split2 strict" in ok and "1.07x" in ok and "same bits" in ok
    bad = sweep_tiles._line(dict(base, error="OutOfResources: shared memory"))
    assert "ERROR OutOfResources" in bad
    ws = dict(base, tiles=dataclasses.asdict(fp8_gemm.WARP_SPECIALIZED))
    line = sweep_tiles._line(dict(ws, ms=1.0, tflops=900.0, vs_default=1.3, same_bits=True))
    assert "128x128x128 s4 warp-specialized " in line and "split" not in line


def test_a_model_that_does_not_fit_is_skipped_and_said(monkeypatch, capsys) -> None:
    """All of a model's experts on one GPU may not fit its memory: the sweep says so, records
    the model as skipped and goes on with the others."""
    tried = []

    def no_memory(e, rows, h, i, precisions):
        tried.append(e)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 GiB")

    monkeypatch.setattr(sweep_tiles, "kernel_calls", no_memory)
    monkeypatch.setattr(sweep_tiles.torch.cuda, "empty_cache", lambda: None)
    records = sweep_tiles.sweep_tiles(["kimi-k2", "dsv3"], 16384, ("fp8",))
    assert tried == [384, 32]
    assert [(r["shape"], r["skipped"]) for r in records] == [
        ("kimi-k2", "out of memory"),
        ("dsv3", "out of memory"),
    ]
    assert "kimi-k2: its 384 experts' operands do not fit" in capsys.readouterr().out


def _schedule(tokens: int, top_k: int, experts: int, world_size: int = 1) -> RowSchedule:
    none = torch.empty(0, dtype=torch.int32)
    return RowSchedule(
        none, none, none, none, none, none, tokens, top_k, experts, 128, 128, world_size
    )


def test_weight_gradient_tiles_follow_the_balanced_rows_per_expert() -> None:
    """Few rows per expert take the two-programs-per-SM tiles; the rule reads host-side sizes
    only (a rank's schedule holds the tokens of every rank and its own experts: an expert
    gets the rows of the whole global batch)."""
    assert gemm.FEW_ROWS_PER_EXPERT == 128
    # DeepSeek-V3 at 4096 tokens: 4096 * 8 / 256 = 128 rows per expert; at 16384: 512
    assert gemm.wgrad_kind(_schedule(4096, 8, 256)) == "wgrad_few_rows"
    assert gemm.wgrad_kind(_schedule(16384, 8, 256)) == "wgrad"
    # W = 8, 32 local experts: 512 tokens per rank is W = 1's global batch of 4096, and its
    # rows per expert; 4096 per rank gives every expert 1024
    assert _schedule(8 * 512, 8, 32, world_size=8).balanced_rows == 128
    assert gemm.wgrad_kind(_schedule(8 * 512, 8, 32, world_size=8)) == "wgrad_few_rows"
    assert _schedule(8 * 4096, 8, 32, world_size=8).balanced_rows == 1024
    # the shared expert: one expert over every token
    assert gemm.wgrad_kind(_schedule(4096, 1, 1)) == "wgrad"
    assert gemm.wgrad_kind(_schedule(129, 1, 1)) == "wgrad"


def test_the_sweep_sets_every_weight_gradient_entry() -> None:
    """Whichever entry the rule picks at a shape, the swept candidate is what runs."""
    t = GemmTiles(bm=64, bn=64, bk=64, stages=2, warps=4)
    before = dict(gemm.GPU_TILES)
    with sweep_tiles._tiles(gemm, "wgrad", t):
        assert gemm.GPU_TILES["wgrad"] == gemm.GPU_TILES["wgrad_few_rows"] == t
        assert gemm.GPU_TILES["mm"] == before["mm"]
    assert gemm.GPU_TILES == before
