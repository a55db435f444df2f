"""`megamoe plot`: a PNG bar chart of layer records; clear errors without layer records."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from megamoe.tools.plot import plot_layer  # noqa: E402


def _record(preset: str, world: int, backend: str, tflops: float) -> dict:
    return dict(
        preset=preset,
        world_size=world,
        backend=backend,
        status="ok",
        gpu="H200",
        commit="abc1234",
        fwd_tflops=tflops,
        fwdbwd_tflops=tflops * 0.9,
        fwdbwd_ms=1.0,
        gemm_peak_tflops=790.0,
    )


def test_plot_writes_a_png(tmp_path):
    records = [
        _record("dsv3", w, b, t)
        for w in (1, 2)
        for b, t in (("triton", 500.0), ("torch-a2a", 300.0))
    ]
    records.append(dict(_record("dsv3", 2, "fused", 0.0), status="skipped"))  # not drawn
    out = tmp_path / "layer.png"
    plot_layer(records, str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_plot_and_its_error(tmp_path):
    good = tmp_path / "r.json"
    good.write_text(json.dumps([_record("qwen3-30b", 1, "triton", 400.0)]))
    png = tmp_path / "p.png"
    run = subprocess.run(
        [sys.executable, "-m", "megamoe", "plot", str(good), "--out", str(png)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert png.exists() and f"wrote {png}" in run.stdout
    bad = tmp_path / "kernels.json"
    bad.write_text(json.dumps([{"shape": "dsv3 down", "tflops": 600.0}]))
    run = subprocess.run(
        [sys.executable, "-m", "megamoe", "plot", str(bad), "--out", str(png)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert "records must hold at least one layer record" in run.stderr


def test_cli_plot_time_against_tokens(tmp_path):
    records = [
        dict(
            _record("dsv3", w, b, 100.0),
            tokens_per_rank=t,
            fwd_ms=t / 1000 * f,
            fwdbwd_ms=t / 300 * f,
        )
        for w in (1, 2)
        for b, f in (("fused", 1.0), ("triton", 1.2))
        for t in (512, 4096)
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(records))
    png = tmp_path / "tokens.png"
    run = subprocess.run(
        [sys.executable, "-m", "megamoe", "plot", str(path), "--out", str(png), "--x", "tokens"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_sweep_variants_get_their_own_series():
    from megamoe.tools.plot import series_name

    records = [dict(_record("dsv3", 2, "fused", 500.0), ring_rows=r) for r in (16384, None)]
    records += [
        dict(_record("dsv3", w, "triton", 450.0), copy_programs=c) for w, c in ((1, None), (2, 24))
    ]  # differs across W only: not a variant
    assert [series_name(r, records) for r in records] == [
        "fused ring_rows=16384",
        "fused ring_rows=None",
        "triton",
        "triton",
    ]


def test_shape_plot_draws_each_mode_and_token_count(tmp_path):
    from megamoe.tools.plot import plot_shapes, shape_name

    records = []
    for model in ("qwen3-30b-a3b", "custom"):
        for mode in ("throughput", "latency"):
            for tokens in (4096, 16384):
                for backend, speedup in (("triton", 1.5), ("auto", 1.4), ("torch-a2a", 1.0)):
                    rec = _record(None, 1, backend, 400.0)
                    rec.update(
                        model=model,
                        mode=mode,
                        tokens_per_rank=tokens,
                        speedup_vs_torch_a2a=speedup,
                        hidden=96,
                        intermediate=64,
                        experts=8,
                        top_k=2,
                        shared_intermediate=0,
                    )
                    records.append(rec)
    assert shape_name(records[-1]) == "96,64,8,2,0"
    assert shape_name(records[0]) == "qwen3-30b-a3b"
    assert shape_name(_record("dsv3", 1, "triton", 1.0)) == "dsv3"
    out = tmp_path / "shapes.png"
    plot_shapes(records, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="a backend other than torch-a2a"):
        plot_shapes([r for r in records if r["backend"] == "torch-a2a"], str(out))


def test_precision_plot_draws_a_bar_per_cadence(tmp_path):
    from megamoe.tools.plot import plot_precision

    records = []
    for model in ("qwen3-30b-a3b", "deepseek-v3"):
        for micro_batches, speedup in ((1, 0.9), (1000, 1.1)):
            bf16 = _record(None, 1, "triton", 400.0)
            bf16.update(model=model, tokens_per_rank=16384, precision="bf16")
            fp8 = dict(bf16, precision="fp8", micro_batches=micro_batches)
            fp8.update(speedup_vs_bf16=speedup, fwd_speedup_vs_bf16=speedup + 0.1)
            records += [bf16, fp8]
    out = tmp_path / "precision.png"
    plot_precision(records, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="fp8 layer records with speedup_vs_bf16"):
        plot_precision([r for r in records if r["precision"] == "bf16"], str(out))
