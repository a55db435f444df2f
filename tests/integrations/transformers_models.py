"""Tiny transformers MoE models for the adapter's CPU tests (built from configs: no downloads),
and the training loop the tests compare implementations with."""

from __future__ import annotations

import copy

import torch

VOCAB = 256


def qwen3_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def deepseek_v3_config(**overrides):
    """One dense layer, then two MoE layers with a shared expert (outside the experts module)
    and group-limited routing (2 groups of 4 experts, 1 group per token)."""
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


MODELS = {"qwen3_moe": qwen3_config, "deepseek_v3": deepseek_v3_config}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A float32 causal LM of MODELS[name], initialized from ``seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(MODELS[name]())
    return model.float()


def twin(model: torch.nn.Module, experts_implementation: str) -> torch.nn.Module:
    """An independent copy of ``model`` (same weights, own config) running the given experts."""
    other = copy.deepcopy(model)
    other.set_experts_implementation(experts_implementation)
    return other


def token_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


def train(model: torch.nn.Module, ids: torch.Tensor, steps: int, lr: float = 3e-3) -> list[float]:
    """``steps`` AdamW steps of next-token loss on the fixed batch ``ids``; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
