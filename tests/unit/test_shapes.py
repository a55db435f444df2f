"""The model-shape table and the shape arguments of the tools (``--model``, ``--shape``)."""

import json
import re

import pytest

from megamoe.shapes import MODEL_SHAPES, get_model_shape
from megamoe.tools.harness import resolve_shape
from support.procs import assert_ok, run_python

# (H, I, global experts, top-k, shared I) of each model as its published config gives them;
# written out here, not read from the package, so that a changed value fails this test.
PUBLISHED = {
    "deepseek-v3": (7168, 2048, 256, 8, 2048),
    "deepseek-v2-lite": (2048, 1408, 64, 6, 2816),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, 0),
    "qwen3-next-80b-a3b": (2048, 512, 512, 10, 512),
    "gpt-oss-20b": (2880, 2880, 32, 4, 0),
    "gpt-oss-120b": (2880, 2880, 128, 4, 0),
    "kimi-k2": (7168, 2048, 384, 8, 2048),
    "glm-4.5": (5120, 1536, 160, 8, 1536),
    "llama-4-scout": (5120, 8192, 16, 1, 8192),
    "olmoe-1b-7b": (2048, 1024, 64, 8, 0),
    "deepseek-v2": (5120, 1536, 160, 6, 3072),
    "mixtral-8x7b": (4096, 14336, 8, 2, 0),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4, 5632),
    "qwen2-57b-a14b": (3584, 2560, 64, 8, 20480),
    "glm-4.5-air": (4096, 1408, 128, 8, 1408),
}


def test_the_table_holds_the_published_shapes_with_their_sources():
    assert set(MODEL_SHAPES) == set(PUBLISHED)
    for name, (h, i, e, k, i_s) in PUBLISHED.items():
        m = get_model_shape(name)
        got = (m.hidden_size, m.intermediate_size, m.num_experts, m.top_k)
        assert got + (m.shared_intermediate_size,) == (h, i, e, k, i_s), name
        assert m.source.endswith("config.json") and "/" in m.source, name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_model_splits_its_experts_over_the_ranks(name):
    m = MODEL_SHAPES[name]
    for world in (1, 2, 4, 8):
        if m.num_experts % world:
            with pytest.raises(ValueError, match="num_experts"):
                m.config(world)
            continue
        cfg = m.config(world, minibatch_rows=512)
        assert cfg.local_experts(world) * world == m.num_experts
        assert cfg.minibatch_rows == 512
        shape = resolve_shape(name)
        assert shape.config(world) == m.config(world)  # the tools' view: global experts


def test_unknown_model_names_the_valid_ones():
    with pytest.raises(ValueError, match="model must be one of .*'deepseek-v3'.*got 'gpt-5'"):
        get_model_shape("gpt-5")
    with pytest.raises(ValueError, match="a model .*qwen3-30b-a3b.* or H,I,E,K\\[,Is\\], got"):
        resolve_shape("gpt-5")


@pytest.mark.parametrize(
    "spec, fields",
    [("1024,512,16,4", (1024, 512, 16, 4, 0)), ("1024,512,16,4,256", (1024, 512, 16, 4, 256))],
)
def test_custom_shapes_are_global_and_recorded_as_custom(spec, fields):
    shape = resolve_shape(spec)
    cfg = shape.config(2)
    got = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k)
    assert got + (cfg.shared_intermediate_size,) == fields
    assert cfg.local_experts(2) == fields[2] // 2
    assert shape.record_fields() == {"preset": None, "model": "custom"}
    assert resolve_shape("qwen3-30b-a3b").record_fields() == {
        "preset": None,
        "model": "qwen3-30b-a3b",
    }
    assert resolve_shape("dsv3").record_fields() == {"preset": "dsv3", "model": None}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("1024,512,16", "shape must be H,I,E,K[,Is] (integers), got '1024,512,16'"),
        ("1024,512,x,4", "shape must be H,I,E,K[,Is] (integers), got '1024,512,x,4'"),
        ("1024,512,16,4,1,2", "shape must be H,I,E,K[,Is] (integers)"),
        ("1024,512,16,32", "top_k"),
        ("0,512,16,4", "hidden_size"),
    ],
)
def test_bad_custom_shapes_are_named(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_shape(spec)


def test_bench_runs_a_model_and_a_custom_shape_and_records_every_shape_field(tmp_path):
    out = tmp_path / "r.json"
    args = (
        "-m megamoe bench --model olmoe-1b-7b --shape 96,64,8,2,32 --tokens 8 --iters 1 "
        "--warmup 0 --backend torch-a2a --out"
    )
    proc = run_python(*args.split(), str(out))
    assert_ok(proc)
    records = {r["model"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"olmoe-1b-7b", "custom"}
    olmoe, custom = records["olmoe-1b-7b"], records["custom"]
    assert (olmoe["hidden"], olmoe["intermediate"], olmoe["experts"], olmoe["top_k"]) == (
        2048,
        1024,
        64,
        8,
    )
    assert olmoe["shared_intermediate"] == 0 and olmoe["local_experts"] == 64
    assert (custom["hidden"], custom["intermediate"], custom["experts"]) == (96, 64, 8)
    assert custom["top_k"] == 2 and custom["shared_intermediate"] == 32
    assert all(r["tokens_per_rank"] == 8 and r["check_ok"] for r in records.values())
    assert "olmoe-1b-7b" in proc.stdout and "custom" in proc.stdout


def test_bench_refuses_a_bad_shape_argument():
    proc = run_python("-m", "megamoe", "bench", "--shape", "1,2,3")
    assert proc.returncode == 2
    assert "shape must be H,I,E,K[,Is] (integers), got '1,2,3'" in proc.stderr


def test_grouped_gemm_bench_shapes_cover_the_table() -> None:
    """The GEMM benchmark's shapes: every table model at W = 1, each expert a whole number of
    16-row groups (torch._grouped_mm's offsets) near tokens * top_k / experts."""
    from megamoe.tools.bench_kernels import gemm_shapes

    shapes = gemm_shapes(["all"], 4096)
    assert [s[0] for s in shapes] == list(MODEL_SHAPES)
    for name, e, rows, h, i in shapes:
        m = MODEL_SHAPES[name]
        assert (e, h, i) == (m.num_experts, m.hidden_size, m.intermediate_size)
        assert rows % 16 == 0 and rows >= 16
        assert abs(rows - 4096 * m.top_k / e) <= 8, name
    assert gemm_shapes(["dsv3"], 4096) == [("dsv3", 32, 1024, 7168, 2048)]
