"""The MoE layer shapes of real models, and the benchmark presets.

:data:`MODEL_SHAPES` holds one routed-expert layer of each model as its published configuration
gives it (global expert count; ``source`` names the file). :data:`PRESETS` are the benchmark's
per-rank shapes (local experts and tokens per rank), kept for records made with them.

    cfg = megamoe.get_model_shape("qwen3-30b-a3b").config(world_size=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import MoEConfig

__all__ = ["ModelShape", "MODEL_SHAPES", "get_model_shape", "Preset", "PRESETS", "get_preset"]


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer of a published model: hidden size, routed expert intermediate size, global
    experts, experts per token and the shared experts' total intermediate size (0: none)."""

    name: str
    source: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    shared_intermediate_size: int
    note: str = ""

    def config(self, world_size: int = 1, **tunables: Any) -> MoEConfig:
        """The layer's config; experts per rank = ``num_experts / world_size``."""
        cfg = MoEConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_experts=self.num_experts,
            top_k=self.top_k,
            shared_intermediate_size=self.shared_intermediate_size,
            **tunables,
        )
        cfg.local_experts(world_size)  # the experts must divide over the ranks
        return cfg


MODEL_SHAPES: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape(
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3 config.json",
            7168,
            2048,
            256,
            8,
            2048,
            "1 shared expert; sigmoid router (Kimi-K2 has the same layer)",
        ),
        ModelShape(
            "deepseek-v2-lite",
            "deepseek-ai/DeepSeek-V2-Lite config.json",
            2048,
            1408,
            64,
            6,
            2816,
            "2 shared experts of 1408",
        ),
        ModelShape("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B config.json", 2048, 768, 128, 8, 0),
        ModelShape("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B config.json", 4096, 1536, 128, 8, 0),
        ModelShape(
            "qwen3-next-80b-a3b",
            "Qwen/Qwen3-Next-80B-A3B-Instruct config.json",
            2048,
            512,
            512,
            10,
            512,
            "1 shared expert (gated)",
        ),
        ModelShape(
            "gpt-oss-20b",
            "openai/gpt-oss-20b config.json",
            2880,
            2880,
            32,
            4,
            0,
            "shape only: its SwiGLU is clamped and biased",
        ),
        ModelShape(
            "gpt-oss-120b",
            "openai/gpt-oss-120b config.json",
            2880,
            2880,
            128,
            4,
            0,
            "shape only: its SwiGLU is clamped and biased",
        ),
        ModelShape(
            "kimi-k2",
            "moonshotai/Kimi-K2-Instruct config.json",
            7168,
            2048,
            384,
            8,
            2048,
            "1 shared expert",
        ),
        ModelShape(
            "glm-4.5", "zai-org/GLM-4.5 config.json", 5120, 1536, 160, 8, 1536, "1 shared expert"
        ),
        ModelShape(
            "llama-4-scout",
            "meta-llama/Llama-4-Scout-17B-16E config.json",
            5120,
            8192,
            16,
            1,
            8192,
            "1 shared expert; top-1",
        ),
        ModelShape("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924 config.json", 2048, 1024, 64, 8, 0),
        ModelShape(
            "deepseek-v2",
            "deepseek-ai/DeepSeek-V2 config.json",
            5120,
            1536,
            160,
            6,
            3072,
            "2 shared experts",
        ),
        ModelShape(
            "mixtral-8x7b",
            "mistralai/Mixtral-8x7B-v0.1 config.json",
            4096,
            14336,
            8,
            2,
            0,
            "8 wide experts",
        ),
        ModelShape(
            "qwen1.5-moe-a2.7b",
            "Qwen/Qwen1.5-MoE-A2.7B config.json",
            2048,
            1408,
            60,
            4,
            5632,
            "60 experts; the shared expert is gated per token (not modelled)",
        ),
        ModelShape(
            "qwen2-57b-a14b",
            "Qwen/Qwen2-57B-A14B config.json",
            3584,
            2560,
            64,
            8,
            20480,
            "H = 7 x 512; the shared expert is gated per token (not modelled)",
        ),
        ModelShape(
            "glm-4.5-air",
            "zai-org/GLM-4.5-Air config.json",
            4096,
            1408,
            128,
            8,
            1408,
            "1 shared expert",
        ),
    )
}


def get_model_shape(name: str) -> ModelShape:
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(f"model must be one of {sorted(MODEL_SHAPES)}, got {name!r}") from None


@dataclass(frozen=True)
class Preset:
    """A benchmark shape, per rank: global experts = local_experts * world size."""

    name: str
    hidden_size: int
    intermediate_size: int
    local_experts: int
    top_k: int
    tokens_per_rank: int
    shared_intermediate_size: int

    def config(self, world_size: int = 1, **tunables: Any) -> MoEConfig:
        return MoEConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_experts=self.local_experts * world_size,
            top_k=self.top_k,
            shared_intermediate_size=self.shared_intermediate_size,
            **tunables,
        )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("dsv3", 7168, 2048, 32, 8, 4096, 2048),
        Preset("qwen3-30b", 2048, 768, 64, 8, 8192, 0),
        Preset("mok-v4", 7168, 3072, 48, 6, 2048, 3072),
        Preset("tiny", 256, 128, 4, 2, 256, 128),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}") from None
