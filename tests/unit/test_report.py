"""Tables of benchmark records (``megamoe table``)."""

from megamoe.tools.bench import RECORD_FIELDS


def _layer_record(backend: str, **fields) -> dict:
    rec = dict(
        preset="dsv3",
        world_size=2,
        backend=backend,
        routing="uniform",
        tokens_per_rank=4096,
        fwd_ms=5.0,
        bwd_ms=10.0,
        fwdbwd_ms=15.0,
        fwd_tflops=100.0,
        fwdbwd_tflops=200.0,
        gemm_peak_tflops=700.0,
        status="ok",
    )
    rec = {**dict.fromkeys(RECORD_FIELDS), **rec, **fields}
    return rec


def test_table_shows_copy_bandwidth_only_when_present():
    from megamoe.tools.report import format_layer_table

    triton = _layer_record(
        "triton",
        dispatch_gbps=301.4,
        combine_gbps=318.6,
        dispatch_bwd_gbps=297.0,
        combine_bwd_gbps=315.2,
        copy_programs=24,
    )
    base = _layer_record("torch-a2a", speedup_vs_torch_a2a=1.0)
    skipped = _layer_record("fused", status="skipped", note="not built")
    lines = format_layer_table([triton, base, skipped]).splitlines()
    for header in (
        "dispatch GB/s",
        "combine GB/s",
        "dy pull GB/s",
        "dx push GB/s",
        "copy programs",
    ):
        assert header in lines[0]
    assert lines[0].rstrip().endswith("check (rel err)")
    assert lines[2].split()[-6:] == ["301", "319", "297", "315", "24", "-"]
    assert lines[3].split()[-6:] == ["-"] * 6
    assert lines[4].endswith("skipped: not built")  # the reason stays in the last column
    md = format_layer_table([triton, base], markdown=True)
    assert "| 301 | 319 | 297 | 315 | 24 | - |" in md
    assert "GB/s" not in format_layer_table([base])
