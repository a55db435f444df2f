"""backend="auto": which backend it takes, by world size, shape and rows (docs/tuning.md)."""

import pytest
import torch

from megamoe import backends
from megamoe.shapes import get_model_shape

GPU = torch.device("cuda")


@pytest.fixture
def every_backend_available(monkeypatch):
    """The rule as on a Hopper GPU, where every backend is available."""
    monkeypatch.setattr(backends, "_availability", lambda *args, **kwargs: (True, "test"))


@pytest.mark.parametrize(
    "model, tokens, expected",
    [
        ("deepseek-v3", 4096, "fused"),  # 7168 x 2048: wide
        ("kimi-k2", 16384, "fused"),
        ("kimi-k2", 4096, "triton"),  # wide, 32768 rows, but 85 per expert
        ("mixtral-8x7b", 4096, "fused"),  # 8192 rows
        ("llama-4-scout", 4096, "triton"),  # wide, but top-1: 4096 rows
        ("llama-4-scout", 16384, "fused"),
        ("deepseek-v3", 512, "triton"),  # 4096 rows
        ("glm-4.5", 16384, "triton"),  # 5120 x 1536: narrow
        ("qwen3-30b-a3b", 16384, "triton"),
        ("gpt-oss-120b", 16384, "triton"),
    ],
)
def test_one_gpu_takes_fused_for_wide_layers_with_enough_rows(
    every_backend_available, model, tokens, expected
):
    cfg = get_model_shape(model).config(1)
    assert backends.resolve_backend("auto", GPU, 1, cfg, torch.bfloat16, tokens) == expected


def test_expert_parallel_takes_fused_and_no_shape_takes_triton(every_backend_available):
    cfg = get_model_shape("qwen3-30b-a3b").config(2)
    assert backends.resolve_backend("auto", GPU, 2, cfg, torch.bfloat16, 4096) == "fused"
    assert backends.resolve_backend("auto", GPU, 1) == "triton"  # nothing known of the layer


def test_the_next_available_backend_is_taken(monkeypatch):
    cfg = get_model_shape("deepseek-v3").config(1)

    def only(name):
        return lambda candidate, *args, **kwargs: (candidate == name, "test")

    monkeypatch.setattr(backends, "_availability", only("triton"))
    assert backends.resolve_backend("auto", GPU, 1, cfg, torch.bfloat16, 4096) == "triton"
    monkeypatch.setattr(backends, "_availability", only("reference"))
    assert backends.resolve_backend("auto", GPU, 1, cfg, torch.bfloat16, 4096) == "reference"


def test_cpu_takes_the_reference_backend():
    cfg = get_model_shape("deepseek-v3").config(1)
    cpu = torch.device("cpu")
    assert backends.resolve_backend("auto", cpu, 1, cfg, torch.bfloat16, 4096) == "reference"
