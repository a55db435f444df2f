"""The end-to-end training benchmark: ``megamoe train-bench``.

A Hugging Face transformers model is built from a config (no download): DeepSeek-V3-shaped
(``dsv3``) or Qwen3-30B-A3B-shaped (``qwen3-30b-a3b``), as many layers as fit on the GPU. It
trains with AdamW on synthetic token ids, once per MoE implementation, and the implementations'
runs are compared in one run of the tool:

- **Implementations** (``--impls``): ``native`` (transformers' ``grouped_mm`` experts) and
  ``megamoe-<backend>`` (``triton``, ``fused``, ``auto``, ``reference``): the experts
  implementation that ``megamoe.integrations.transformers`` registers in transformers'
  ``ExpertsInterface``, selected with ``model.set_experts_implementation(key)``. Only the
  routed experts change; attention, router, shared expert (DeepSeek-V3 adds it outside the
  experts module), loss and optimizer are transformers' and PyTorch's in every run.
- **Routing** (``--routing``): ``learned`` (the model's router) or ``balanced``: each MoE
  block's router (its ``gate`` module) still runs, but its forward is wrapped so that the ids
  it returns are a fixed round robin (:func:`balanced_ids`: token ``t``, slot ``k`` takes expert
  ``(t + k * E / K) mod E``, or ``(t * K + k) mod E`` when ``K`` does not divide ``E``; every
  expert gets ``T * K / E`` rows when ``E`` divides ``T``) with weights ``1 / K``, the same for
  every implementation. The router then gets no gradient.
- **Same start, same data.** The model is built once (seeded, on the device), its state is
  copied to (pinned) host memory and loaded back before every run; every run has a fresh AdamW
  (``fused=True`` on a GPU) and trains on the same batches: token ids of a fixed random bigram
  chain (:func:`make_batches`, 4 successors per token), so the loss falls from ``ln V``
  towards ``ln 4`` and the runs' losses can be compared step by step.
- **Runs in rounds, mirrored.** One replica of the model (with its gradients and AdamW state,
  8 bytes per parameter in bf16) is what fits; three resident replicas would leave DeepSeek-V3
  two layers, and parking the idle ones in host memory would take 6 bytes per parameter each.
  So every run is a whole training run (``warmup + steps`` steps from the same start), and the
  runs are interleaved as whole runs: round 1 in ``--impls`` order, round 2 reversed, ...
  (:func:`run_order`; ``--rounds``, default 2), so that a drift of the GPU's clocks over the
  tool's run hits every implementation alike. A second round also repeats every run from the
  same start: ``deterministic`` says whether its losses came out bit for bit the same. That is
  the whole model's property: on a GPU the native parts (attention's and the embedding's
  backward) are not deterministic unless ``torch.use_deterministic_algorithms`` is on, which
  the benchmark leaves off unless ``--deterministic-algorithms`` (recorded as
  ``deterministic_algorithms``; it slows native parts down). The 200-step GPU test turns it on
  and checks megamoe's bits.
- **Timing.** CUDA events around each step (``zero_grad``, forward, loss, backward,
  ``optimizer.step``; no host sync between steps, the host runs ahead); ``step_ms`` is the
  median over the timed steps (after ``warmup``) of every round, ``host_step_ms`` the median of
  the host's wall time of the same calls. ``tokens_per_s_per_gpu`` = tokens per step and GPU
  over ``step_ms``. ``--microbatches M`` accumulates the gradients of ``M`` micro-batches of
  ``--tokens`` before each optimizer step (each loss scaled by ``1 / M``): a step then holds
  ``M * tokens`` tokens, and the optimizer's fixed cost is spread over them as in training
  runs with large batches. ``--optimizer megamoe`` (:data:`OPTIMIZERS`) updates the large
  parameters with ``megamoe.optim.AdamW`` and the rest with torch's fused AdamW;
  ``megamoe-copies`` also has megamoe's update write the fp8 layers' weight copies.
- **Where the time goes** (``--breakdown``, :mod:`megamoe.tools.step_parts`): marks on the
  routed experts, the MoE blocks, attention and the optimizer step in every timed step of every
  run (the same marks for every implementation); ``breakdown_ms`` holds each part's median ms
  per step and ``rest`` (the step less the MoE blocks, attention and the optimizer: embedding,
  norms, dense layers, LM head and loss, and the GPU's waits for the host). Every run also
  reports ``host_syncs``, the Python lines that made the host wait for the GPU in its last
  warm-up step (PyTorch's sync debug mode), and ``alloc_retries``, how often the caching
  allocator had to free its cache to satisfy a request (each a device sync).
- **FLOPs and MFU** (:func:`flops_per_step`): ``6 * N_active * tokens`` + attention, with
  ``N_active`` the weight-matrix parameters one token's forward multiplies with: every matrix
  of the model (attention projections, router, shared expert, dense MLPs, LM head) and
  ``top_k / num_experts`` of the routed experts' matrices; not the input embedding (a lookup)
  nor the norms' vectors. Attention adds ``3 * layers * batch * heads * seq**2 * (d_qk + d_v)``
  (causal: half of the ``2 * seq**2 * (d_qk + d_v)`` FLOPs per head of the score and value
  products; backward = 2x forward). ``mfu`` = those FLOPs over ``step_ms``, over the dense bf16
  GEMM rate measured at the start of the same run (``dense_tflops``: median of a 8192^3
  ``torch.matmul``, :func:`megamoe.tools.bench.measure_gemm_peak`).
- **Memory** (:func:`estimate_memory`): parameters, gradients and the two AdamW moments (in the
  parameters' dtype), activations per layer and token and the LM head's logits, and with an
  fp8 implementation the expert weights' fp8 copies (two layouts, kept until the optimizer
  step); ``--layers`` defaults to the most layers whose estimate fits the GPU's free memory
  (printed). ``peak_mem_gb`` is ``torch.cuda.max_memory_allocated`` of the run (reset before
  each run).

Without a GPU (or with ``--tiny``) tiny models of both shapes run in float32 with ``native``
and ``megamoe-reference`` for 3 steps: a smoke test of the whole path, not a measurement.

Records (a JSON list, ``--out``; :data:`RECORD_FIELDS`): one per model x impl x routing, kind
"train". Expert parallelism (torchrun, W > 1) is not run yet: the records and the per-GPU
rates are laid out for it (``world_size``, tokens per GPU), and the model would be built
through transformers' ``from_pretrained(..., distributed_config=DistributedConfig(ep_size=W))``
with megamoe's expert-parallel implementation; W > 1 raises until then.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = [
    "RECORD_FIELDS",
    "MODELS",
    "IMPLS",
    "ROUTINGS",
    "NATIVE_KEY",
    "TrainModel",
    "TrainOptions",
    "ParamCounts",
    "MemoryEstimate",
    "balanced_ids",
    "install_routing",
    "run_order",
    "make_batches",
    "count_params",
    "flops_per_step",
    "estimate_memory",
    "fit_layers",
    "build_model",
    "experts_key",
    "megamoe_experts_key",
    "train_run",
    "run_train_bench",
    "add_arguments",
    "cmd_train_bench",
    "main",
]

# The fields of a train record, in order (BENCHMARKS-style: null where a value does not apply).
RECORD_FIELDS: tuple[str, ...] = (
    "kind",
    "model",
    "impl",
    "routing",
    "world_size",
    "precision",
    "tokens_per_s_per_gpu",
    "mfu",
    "step_ms",
    "step_ms_all",
    "losses",
    "peak_mem_gb",
    "layers",
    "tokens",
    "gpu",
    "commit",
    "date",
    "torch",
    "triton",
    "transformers",
    "dense_tflops",
    "speedup_vs_native",
    # the run's facts and the rest of its measurements
    "host_step_ms",
    "model_tflops",
    "flops_per_step",
    "active_params",
    "params",
    "seq_len",
    "batch_size",
    "steps",
    "warmup",
    "rounds",
    "lr",
    "experts_implementation",
    "deterministic",
    "deterministic_algorithms",
    "estimated_mem_gb",
    "microbatches",
    "optimizer",
    "breakdown_ms",
    "host_syncs",
    "alloc_retries",
    "status",
    "note",
)

# transformers' own experts implementation (the default one of its MoE models).
NATIVE_KEY = "grouped_mm"
# impl name -> (megamoe backend, MoEConfig.precision) (None: transformers' native experts).
IMPLS: dict[str, tuple[str, str] | None] = {
    "native": None,
    "megamoe-triton": ("triton", "bf16"),
    "megamoe-fused": ("fused", "bf16"),
    "megamoe-auto": ("auto", "bf16"),
    "megamoe-reference": ("reference", "bf16"),
    "megamoe-triton-fp8": ("triton", "fp8"),
    "megamoe-auto-fp8": ("auto", "fp8"),
    "megamoe-reference-fp8": ("reference", "fp8"),
}
GPU_DEFAULT_IMPLS = ("native", "megamoe-triton", "megamoe-fused")
CPU_DEFAULT_IMPLS = ("native", "megamoe-reference")
ROUTINGS = ("learned", "balanced")
ROUTING_CHOICES = (*ROUTINGS, "both")

DEFAULT_SEED = 1234
DEFAULT_VOCAB = 32768
DEFAULT_LR = 3e-4
# Successors per token of the synthetic bigram chain (the loss floor is ln of it).
BIGRAM_BRANCHING = 4
# Peak of a training step that the estimate does not model (allocator slack, kernels'
# workspaces, CUDA context): kept free when the layers are fitted.
MEMORY_RESERVE_FRACTION = 0.08
MEMORY_RESERVE_BYTES = 4 * 2**30
# AdamW keeps two moments per parameter, in the parameter's dtype.
ADAM_STATES = 2


# ------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class TrainModel:
    """A model to build: its transformers family, the config's fields (less the layer count and
    vocabulary) and the published model's layer count (the most ``--layers`` may ask for)."""

    name: str
    family: str  # "deepseek_v3" or "qwen3_moe"
    fields: dict[str, Any]
    full_layers: int
    default_layers: int | None = None  # tiny models: fixed; else fitted to the memory
    tiny: bool = False
    # parameters and buffers kept in float32 in a bf16 model (DeepSeek-V3's router, as
    # transformers >= 5.18 declares it and from_pretrained keeps it)
    fp32_names: tuple[str, ...] = ()

    def config(self, layers: int, vocab_size: int, seq_len: int):
        """The transformers config with ``layers`` layers."""
        if self.family == "deepseek_v3":
            from transformers import DeepseekV3Config as config_class
        elif self.family == "qwen3_moe":
            from transformers import Qwen3MoeConfig as config_class
        else:  # pragma: no cover - the table below holds only these
            raise ValueError(f"unknown model family {self.family!r}")
        return config_class(
            **self.fields,
            num_hidden_layers=layers,
            vocab_size=vocab_size,
            max_position_embeddings=max(seq_len, 4096),
            use_cache=False,
            tie_word_embeddings=False,
        )

    # the dims the FLOP count and memory estimate read
    @property
    def hidden(self) -> int:
        return self.fields["hidden_size"]

    @property
    def num_experts(self) -> int:
        f = self.fields
        return f["n_routed_experts"] if self.family == "deepseek_v3" else f["num_experts"]

    @property
    def top_k(self) -> int:
        return self.fields["num_experts_per_tok"]

    @property
    def moe_intermediate(self) -> int:
        return self.fields["moe_intermediate_size"]

    @property
    def shared_intermediate(self) -> int:
        f = self.fields
        if self.family == "deepseek_v3":
            return f["moe_intermediate_size"] * f["n_shared_experts"]
        return 0

    @property
    def expert_weight_elements(self) -> int:
        """Elements of one layer's routed and shared expert weights (gate, up and down): what
        an fp8 run keeps quantized in two layouts until the optimizer step."""
        return (
            3 * self.hidden * (self.num_experts * self.moe_intermediate + self.shared_intermediate)
        )

    @property
    def attention_dims(self) -> tuple[int, int, int]:
        """(query heads, query/key head dim, value head dim)."""
        f = self.fields
        if self.family == "deepseek_v3":
            d_qk = f["qk_nope_head_dim"] + f["qk_rope_head_dim"]
            return f["num_attention_heads"], d_qk, f["v_head_dim"]
        return f["num_attention_heads"], f["head_dim"], f["head_dim"]


def _dsv3_fields(**over: Any) -> dict[str, Any]:
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json) with 32 routed experts: the experts of
    # one of 8 ranks. Every layer is an MoE layer (first_k_dense_replace 0); default RoPE
    # (DeepSeek-V3's YaRN changes no shape or FLOP).
    fields = dict(
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=32,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_group=8,  # 4 experts per group, 4 groups kept: 16 candidates for the top 8
        topk_group=4,
        num_experts_per_tok=8,
        first_k_dense_replace=0,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
    )
    fields.update(over)
    return fields


def _qwen3_fields(**over: Any) -> dict[str, Any]:
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json).
    fields = dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        output_router_logits=False,
    )
    fields.update(over)
    return fields


_DSV3_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

MODELS: dict[str, TrainModel] = {
    m.name: m
    for m in (
        TrainModel("dsv3", "deepseek_v3", _dsv3_fields(), 61, fp32_names=_DSV3_FP32),
        TrainModel("qwen3-30b-a3b", "qwen3_moe", _qwen3_fields(), 48),
        # tiny versions of both (CPU smoke runs and tests)
        TrainModel(
            "dsv3-tiny",
            "deepseek_v3",
            _dsv3_fields(
                hidden_size=64,
                intermediate_size=128,
                moe_intermediate_size=32,
                num_attention_heads=4,
                num_key_value_heads=4,
                n_routed_experts=8,
                kv_lora_rank=16,
                q_lora_rank=32,
                qk_rope_head_dim=8,
                qk_nope_head_dim=16,
                v_head_dim=16,
                n_group=2,
                topk_group=1,
                num_experts_per_tok=2,
            ),
            2,
            default_layers=2,
            tiny=True,
            fp32_names=_DSV3_FP32,
        ),
        TrainModel(
            "qwen3-30b-a3b-tiny",
            "qwen3_moe",
            _qwen3_fields(
                hidden_size=64,
                intermediate_size=128,
                moe_intermediate_size=32,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_experts=8,
                num_experts_per_tok=2,
            ),
            2,
            default_layers=2,
            tiny=True,
        ),
    )
}
BENCH_MODELS = tuple(name for name, m in MODELS.items() if not m.tiny)
TINY_DEFAULTS = dict(tokens=64, seq_len=32, steps=3, warmup=1, vocab_size=512)


def tiny_name(name: str) -> str:
    """The tiny model of a benchmark model (a tiny one stays itself)."""
    return name if MODELS[name].tiny else f"{name}-tiny"


# ------------------------------------------------------------------------------------ routing


def balanced_ids(
    tokens: int,
    top_k: int,
    num_experts: int,
    *,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Forced-balanced routing ids ``[tokens, top_k]`` (int64): token ``t`` (counted from
    ``offset``: a rank's first global token under expert parallelism), slot ``k`` takes expert
    ``(t + k * E // K) % E`` when ``K`` divides ``E`` (a token's experts spread evenly over the
    expert range, so over the ranks too), else ``(t * K + k) % E``. The ids of a token are
    distinct; every expert gets ``tokens * K / E`` rows when ``E`` divides ``tokens``."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    t = torch.arange(offset, offset + tokens, device=device, dtype=torch.int64)[:, None]
    k = torch.arange(top_k, device=device, dtype=torch.int64)[None, :]
    if num_experts % top_k == 0:
        return (t + k * (num_experts // top_k)) % num_experts
    return (t * top_k + k) % num_experts


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE blocks: modules with a ``gate`` (router) and ``experts`` holding the
    stacked ``gate_up_proj`` (DeepseekV3MoE, Qwen3MoeSparseMoeBlock, ...)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "gate") and hasattr(getattr(m, "experts", None), "gate_up_proj")
    ]


def _balanced_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """A router's forward with forced-balanced ids and uniform weights (bound per instance)."""
    inner = self.__dict__["_megamoe_learned_forward"] or type(self).forward.__get__(self)
    logits, weights, ids = inner(hidden_states, *args, **kwargs)
    tokens, top_k = ids.shape
    key = (tokens, top_k, ids.device)
    cache = self.__dict__["_megamoe_balanced_ids"]
    if key not in cache:
        cache[key] = balanced_ids(tokens, top_k, self.num_experts, device=ids.device)
    return logits, torch.full_like(weights, 1.0 / top_k), cache[key]


def install_routing(model: torch.nn.Module, routing: str) -> int:
    """Set the routing of every MoE block: "balanced" binds :func:`_balanced_forward` to the
    block's router instance (around the forward it had), "learned" puts that forward back.
    Returns the number of routers."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {list(ROUTINGS)}, got {routing!r}")
    blocks = moe_blocks(model)
    for block in blocks:
        gate = block.gate
        d = gate.__dict__
        if "_megamoe_learned_forward" in d:  # balanced now: back to the learned forward
            saved = d.pop("_megamoe_learned_forward")
            d.pop("_megamoe_balanced_ids", None)
            d.pop("forward", None)
            if saved is not None:
                gate.forward = saved
        if routing == "balanced":
            d["_megamoe_learned_forward"] = d.get("forward")  # None: the class's forward
            d["_megamoe_balanced_ids"] = {}
            gate.forward = types.MethodType(_balanced_forward, gate)
    return len(blocks)


# --------------------------------------------------------------------------------- the runs


def run_order(impls: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, impl) of every run in order: round 0 in the given order, round 1 reversed,
    round 2 in order again, ...: a linear drift of the GPU's speed over the tool's run moves
    every implementation's mean alike, and no implementation always runs first."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    order = []
    for r in range(rounds):
        seq = list(impls) if r % 2 == 0 else list(reversed(impls))
        order += [(r, impl) for impl in seq]
    return order


def make_batches(
    steps: int, batch_size: int, seq_len: int, vocab_size: int, seed: int = DEFAULT_SEED
) -> torch.Tensor:
    """Token ids ``[steps, batch_size, seq_len]`` (int64, CPU) of a random bigram chain: a fixed
    table gives each token :data:`BIGRAM_BRANCHING` successors and each position draws one,
    so a model can learn to predict the next token (the loss falls from ``ln vocab`` towards
    ``ln BIGRAM_BRANCHING``). The same for every run with the same arguments."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.randint(vocab_size, (vocab_size, BIGRAM_BRANCHING), generator=gen)
    rows = steps * batch_size
    pick = torch.randint(BIGRAM_BRANCHING, (rows, seq_len), generator=gen)
    ids = torch.empty((rows, seq_len), dtype=torch.int64)
    ids[:, 0] = torch.randint(vocab_size, (rows,), generator=gen)
    for i in range(1, seq_len):
        ids[:, i] = succ[ids[:, i - 1], pick[:, i]]
    return ids.view(steps, batch_size, seq_len)


# ------------------------------------------------------------------------ counts and estimates


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model: all of them, the input embedding's, the routed experts' and the
    weight-matrix parameters one token's forward multiplies with (``active``)."""

    total: int
    embedding: int
    routed: int
    active: int
    by_dtype_bytes: int  # bytes of all parameters in their dtypes


def _meta_model(spec: TrainModel, layers: int, vocab_size: int, seq_len: int, dtype):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            spec.config(layers, vocab_size, seq_len), dtype=dtype, attn_implementation="sdpa"
        )
    _keep_fp32(model, spec)
    return model


def _keep_fp32(model: torch.nn.Module, spec: TrainModel) -> None:
    if not spec.fp32_names:
        return
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.dtype != torch.float32 and any(name.endswith(n) for n in spec.fp32_names):
                p.data = p.data.float()


def count_params(model: torch.nn.Module) -> ParamCounts:
    """Counts of a built (or meta) model; see :class:`ParamCounts`."""
    routed: dict[int, float] = {}  # id of a routed expert parameter -> top_k / num_experts
    for block in moe_blocks(model):
        for p in block.experts.parameters():
            routed[id(p)] = block.gate.top_k / block.gate.num_experts
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = embedding = routed_total = 0
    active = 0.0
    nbytes = 0
    for p in model.parameters():
        n = p.numel()
        total += n
        nbytes += n * p.element_size()
        if p is embed and p is not head:
            embedding += n
            continue
        if id(p) in routed:
            routed_total += n
            active += n * routed[id(p)]
        elif p.dim() >= 2:
            active += n
    return ParamCounts(total, embedding, routed_total, int(round(active)), nbytes)


def flops_per_step(
    active_params: int, spec: TrainModel, layers: int, batch_size: int, seq_len: int
) -> float:
    """Model FLOPs of one training step (forward + backward) on ``batch_size x seq_len``
    tokens: ``6 * active_params * tokens`` + causal attention ``3 * layers * batch * heads *
    seq^2 * (d_qk + d_v)`` (module docstring)."""
    heads, d_qk, d_v = spec.attention_dims
    tokens = batch_size * seq_len
    attention = 3 * layers * batch_size * heads * seq_len**2 * (d_qk + d_v)
    return float(6 * active_params * tokens + attention)


def activation_bytes_per_token(spec: TrainModel, dtype_bytes: int = 2) -> float:
    """Estimated bytes one layer keeps for the backward, per token: the two RMSNorms (a float32
    and a bf16 copy each), the attention's projections, rotary outputs, the scores' q, k, v and
    output and the output projection's input, and per routed row its input row, gate/up output,
    SwiGLU output, down projection input and output (what transformers' grouped_mm keeps; megamoe
    keeps about the same), the router's float32 input (DeepSeek-V3) and the shared expert."""
    h, i, k = spec.hidden, spec.moe_intermediate, spec.top_k
    heads, d_qk, d_v = spec.attention_dims
    f = spec.fields
    b = dtype_bytes
    norms = 2 * (4 + b) * h
    if spec.family == "deepseek_v3":  # MLA: q from a low-rank q, k and v from one latent
        nope = f["qk_nope_head_dim"]
        low_rank = (4 + b) * (f["q_lora_rank"] + f["kv_lora_rank"])
        attention = b * heads * (4 * d_qk + (nope + d_v) + 2 * d_v) + low_rank
        router = 4 * h + 8 * spec.num_experts
    else:  # GQA with q/k norms
        kv_heads = f["num_key_value_heads"]
        attention = (3 * b + 4) * (heads + kv_heads) * d_qk + b * kv_heads * d_v
        attention += 2 * b * heads * d_v
        router = 8 * spec.num_experts
    routed = b * k * (2 * h + 4 * i)
    shared = 4 * b * spec.shared_intermediate
    return float(norms + attention + routed + router + shared)


@dataclass(frozen=True)
class MemoryEstimate:
    layers: int
    params_per_layer: int
    fixed_params: int  # embedding, LM head, final norm
    state_bytes: float  # parameters + gradients + AdamW moments
    activation_bytes: float  # every layer's, at the start of the backward
    logits_bytes: float
    total_bytes: float
    fp8_bytes: float = 0.0  # the expert weights' fp8 copies (an fp8 run)

    def describe(self) -> str:
        gb = 1e9
        fp8 = f", fp8 weight copies {self.fp8_bytes / gb:.2f} GB" if self.fp8_bytes else ""
        return (
            f"{self.layers} layers x {_count(self.params_per_layer)} params + "
            f"{_count(self.fixed_params)} (embedding, head, norm): weights + grads + AdamW "
            f"{self.state_bytes / gb:.2f} GB, activations {self.activation_bytes / gb:.2f} GB, "
            f"logits {self.logits_bytes / gb:.2f} GB{fp8}: peak {self.total_bytes / gb:.2f} GB"
        )


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


def estimate_memory(
    spec: TrainModel,
    layers: int,
    tokens: int,
    params_per_layer: int,
    fixed_params: int,
    *,
    dtype_bytes: int = 2,
    vocab_size: int = DEFAULT_VOCAB,
    microbatches: int = 1,
    fp8: bool = False,
) -> MemoryEstimate:
    """Peak device bytes of a training step at ``layers`` layers (the parameters in
    ``dtype_bytes``, AdamW's moments in the same dtype, gradients set to None between steps).
    With ``fp8`` (an fp8 run among the implementations) also the expert weights' fp8 copies, a
    byte per element in each of two layouts, which the weight cache keeps from the first forward
    through the optimizer step (docs/fp8.md, "Weights").

    The peak is the larger of the start of the backward (weights, moments and every layer's
    activations, :func:`activation_bytes_per_token`) and the optimizer step (weights, gradients
    and moments), plus one layer's activations (the backward's working set) and the logits
    (the head's output, its float32 copy for the loss and their gradients). On an H200 at 4096
    tokens the optimizer step is the larger for both models (gradients of a layer outweigh its
    activations), and the measured peaks were 1-3 GB below this estimate for native and about at
    it for megamoe (its workspaces). With ``microbatches > 1`` (``tokens`` per micro-batch) the
    gradients of the earlier micro-batches are held whole through every later backward, so the
    start of a backward holds them too (measured: 147 GB for Qwen3-30B-A3B-shaped, 25 layers,
    four micro-batches, against 127 GB with one)."""
    b = dtype_bytes
    params = layers * params_per_layer + fixed_params
    act_layer = tokens * activation_bytes_per_token(spec, b)
    fp8_copies = 2 * layers * spec.expert_weight_elements if fp8 else 0
    state = params * b * (2 + ADAM_STATES)
    grads_held = 1 if microbatches > 1 else 0
    backward = params * b * (1 + grads_held + ADAM_STATES) + layers * act_layer
    logits = tokens * vocab_size * (2 * b + 2 * 4)
    total = max(state, backward) + fp8_copies + act_layer + logits
    return MemoryEstimate(
        layers, params_per_layer, fixed_params, state, layers * act_layer, logits, total, fp8_copies
    )


def layer_params(spec: TrainModel, vocab_size: int, seq_len: int, dtype) -> tuple[int, int]:
    """(parameters per layer, parameters outside the layers), from meta models of 1 and 2
    layers (every layer of these models is the same MoE layer)."""
    one = count_params(_meta_model(spec, 1, vocab_size, seq_len, dtype)).total
    two = count_params(_meta_model(spec, 2, vocab_size, seq_len, dtype)).total
    return two - one, 2 * one - two


def fit_layers(
    spec: TrainModel,
    budget_bytes: float,
    tokens: int,
    params_per_layer: int,
    fixed_params: int,
    *,
    dtype_bytes: int = 2,
    vocab_size: int = DEFAULT_VOCAB,
    microbatches: int = 1,
    fp8: bool = False,
) -> MemoryEstimate:
    """The estimate of the most layers (1 to the published model's count) whose estimate fits
    ``budget_bytes``; 1 layer when none does (the run may then run out of memory)."""
    best = None
    for layers in range(1, spec.full_layers + 1):
        est = estimate_memory(
            spec,
            layers,
            tokens,
            params_per_layer,
            fixed_params,
            dtype_bytes=dtype_bytes,
            vocab_size=vocab_size,
            microbatches=microbatches,
            fp8=fp8,
        )
        if est.total_bytes > budget_bytes and best is not None:
            break
        best = est
        if est.total_bytes > budget_bytes:
            break
    assert best is not None
    return best


def memory_budget(device: torch.device) -> float:
    """Free device bytes less the reserve (:data:`MEMORY_RESERVE_FRACTION` of the total and
    :data:`MEMORY_RESERVE_BYTES`)."""
    free, total = torch.cuda.mem_get_info(device)
    return free - MEMORY_RESERVE_FRACTION * total - MEMORY_RESERVE_BYTES


# ---------------------------------------------------------------------------- experts keys


def megamoe_experts_key(backend: str, precision: str = "bf16") -> str:
    """The transformers experts implementation of a megamoe backend and precision, as
    ``megamoe.integrations.transformers`` registers it (importing it registers them)."""
    try:
        from ..integrations import transformers as hf_integration
    except ImportError as exc:
        raise RuntimeError(
            f"megamoe backend {backend!r} needs megamoe.integrations.transformers, which does not "
            f"import here ({exc})"
        ) from exc
    return hf_integration.experts_implementation(backend, precision)


def experts_key(impl: str) -> str:
    """The experts implementation key of ``impl`` (:data:`IMPLS`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    run = IMPLS[impl]
    return NATIVE_KEY if run is None else megamoe_experts_key(*run)


def impl_precision(impl: str, opts: "TrainOptions") -> str:
    """The record's precision: the model's ("bf16"; "fp32" for the tiny models), or "fp8" for
    an fp8 megamoe impl (its expert GEMMs in the block-scaled recipe, the rest as the model)."""
    run = IMPLS[impl]
    return "fp8" if run is not None and run[1] == "fp8" else opts.precision


def impl_status(impl: str, device: torch.device) -> tuple[bool, str]:
    """Whether ``impl`` can run on ``device`` (megamoe's backend availability)."""
    run = IMPLS[impl]
    if run is None or run[0] == "auto":
        return True, ""
    backend = run[0]
    from ..backends import available_backends

    return available_backends(device).get(backend, (False, f"unknown backend {backend!r}"))


# ----------------------------------------------------------------------------------- options


@dataclass
class TrainOptions:
    models: list[str] = field(default_factory=lambda: list(BENCH_MODELS))
    impls: list[str] | None = None  # None: GPU_DEFAULT_IMPLS, or CPU_DEFAULT_IMPLS when tiny
    routings: list[str] = field(default_factory=lambda: list(ROUTINGS))
    layers: int | None = None  # None: fitted to the memory (tiny: the model's default)
    tokens: int | None = None  # per micro-batch, GPU (batch_size x seq_len); None: 4096 (tiny 64)
    microbatches: int = 1  # micro-batches per optimizer step (gradient accumulation)
    optimizer: str = "torch"  # OPTIMIZERS: who updates the fp8 layers' expert weights
    breakdown: bool = False  # time the parts of each step (megamoe.tools.step_parts)
    deterministic_algorithms: bool = False  # torch.use_deterministic_algorithms for the runs
    seq_len: int | None = None  # None: min(tokens, 4096) (tiny 32)
    steps: int | None = None  # timed steps per run; None: 30 (tiny 3)
    warmup: int | None = None  # untimed steps first; None: 5 (tiny 1)
    rounds: int = 2
    lr: float = DEFAULT_LR
    vocab_size: int | None = None  # None: 32768 (tiny 512)
    seed: int = DEFAULT_SEED
    tiny: bool = False
    device: torch.device | None = None

    def __post_init__(self) -> None:
        if self.device is None:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
        elif self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda":
            self.tiny = True  # no GPU: the CPU smoke run
        for name in self.models:
            if name not in MODELS:
                raise ValueError(f"model must be one of {list(BENCH_MODELS)}, got {name!r}")
        if not self.models:
            raise ValueError("models: give at least one of " + ", ".join(BENCH_MODELS))
        if self.tiny:
            self.models = list(dict.fromkeys(tiny_name(m) for m in self.models))
            for key, value in TINY_DEFAULTS.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
        if self.impls is None:
            self.impls = list(CPU_DEFAULT_IMPLS if self.tiny else GPU_DEFAULT_IMPLS)
        self.impls = list(dict.fromkeys(self.impls))
        for impl in self.impls:
            if impl not in IMPLS:
                raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
        if not self.impls:
            raise ValueError("impls: give at least one of " + ", ".join(IMPLS))
        self.routings = list(dict.fromkeys(self.routings))
        for r in self.routings:
            if r not in ROUTINGS:
                raise ValueError(f"routing must be one of {list(ROUTING_CHOICES)}, got {r!r}")
        self.tokens = 4096 if self.tokens is None else self.tokens
        self.seq_len = min(self.tokens, 4096) if self.seq_len is None else self.seq_len
        self.steps = 30 if self.steps is None else self.steps
        self.warmup = 5 if self.warmup is None else self.warmup
        self.vocab_size = DEFAULT_VOCAB if self.vocab_size is None else self.vocab_size
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.tokens < 1 or self.tokens % self.seq_len:
            raise ValueError(
                f"tokens must be a positive multiple of seq_len={self.seq_len} (batch x seq), "
                f"got {self.tokens}"
            )
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    @property
    def batch_size(self) -> int:
        return self.tokens // self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.tokens * self.microbatches

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.tiny else torch.bfloat16

    @property
    def precision(self) -> str:
        return "fp32" if self.tiny else "bf16"


# ------------------------------------------------------------------------------ build, train


def build_model(spec: TrainModel, layers: int, opts: TrainOptions, seed: int | None = None):
    """The model on ``opts.device`` in ``opts.dtype``, initialized from ``seed`` (transformers'
    init, run on the device), sdpa attention, training mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(opts.seed if seed is None else seed)
    with torch.device(opts.device):
        model = AutoModelForCausalLM.from_config(
            spec.config(layers, opts.vocab_size, opts.seq_len),
            dtype=opts.dtype,
            attn_implementation="sdpa",
        )
    _keep_fp32(model, spec)
    model.train()
    return model


# Pinned host memory comes in powers of two (PyTorch's host allocator rounds a request up to
# one), so the snapshot packs tensors into chunks of this size; a larger tensor gets its own.
PIN_CHUNK_BYTES = 2**30


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(nbytes, dtype=torch.uint8)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of the state dict (in pinned memory when the model is on a GPU)."""
    items = list(model.state_dict().items())
    if not any(t.is_cuda for _, t in items):
        return {name: t.detach().clone() for name, t in items}
    out: dict[str, torch.Tensor] = {}
    chunk, used = None, 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        size = -(-nbytes // 64) * 64
        if size > PIN_CHUNK_BYTES:
            buf, off = _host_buffer(nbytes, pin=True), 0
        else:
            if chunk is None or used + size > PIN_CHUNK_BYTES:
                chunk, used = _host_buffer(PIN_CHUNK_BYTES, pin=True), 0
            buf, off = chunk, used
            used += size
        host = buf[off : off + nbytes].view(t.dtype).view(t.shape)
        host.copy_(t.detach())
        out[name] = host
    return out


def restore(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a :func:`snapshot` back in place."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(state[name], non_blocking=True)
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


# "torch": torch's AdamW for every parameter; "megamoe": megamoe.optim.AdamW for the large
# parameters, torch's for the rest; "megamoe-copies": megamoe's also for the expert weights of
# fp8 layers, its update writing their fp8 copies (make_optimizer).
OPTIMIZERS = ("torch", "megamoe", "megamoe-copies")
# Parameters of at least this many elements go to megamoe's AdamW under ``--optimizer megamoe``
# (one launch each, 1.33x torch's fused update on dsv3's expert weights, BENCHMARKS.md); the
# smaller ones stay in torch's one multi-tensor launch.
MEGAMOE_UPDATE_NUMEL = 1 << 20


class _Optimizers:
    """Several optimizers stepped as one (the train loop's ``step`` and ``zero_grad``)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def make_optimizer(model: torch.nn.Module, lr: float, device: torch.device, kind: str = "torch"):
    """AdamW over the trainable parameters (:data:`OPTIMIZERS`): torch's fused AdamW, or with
    ``kind`` "megamoe" ``megamoe.optim.AdamW`` for the contiguous parameters of at least
    :data:`MEGAMOE_UPDATE_NUMEL` elements and torch's for the rest; "megamoe-copies" also
    gives megamoe's the expert weights of ``model``'s fp8 layers, with their views (its update
    writes their fp8 copies)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs: dict[str, Any] = {"fused": True} if device.type == "cuda" else {"foreach": False}
    if kind == "torch":
        return torch.optim.AdamW(params, lr=lr, **kwargs)
    from .. import optim

    views = optim.fp8_weight_views(model) if kind == "megamoe-copies" else []
    copied = optim.parameters_of(views, params)
    ours = [
        p
        for p in params
        if any(p is q for q in copied) or (p.numel() >= MEGAMOE_UPDATE_NUMEL and p.is_contiguous())
    ]
    if not ours:
        return torch.optim.AdamW(params, lr=lr, **kwargs)
    rest = [p for p in params if all(p is not q for q in ours)]
    mine = optim.AdamW(ours, lr=lr, fp8_views=views)
    return _Optimizers(torch.optim.AdamW(rest, lr=lr, **kwargs), mine) if rest else mine


@dataclass
class RunResult:
    """One run: per step losses (every step), device and host ms (timed steps), peak bytes, and
    with a breakdown the median ms of each part of a step; the host lines that synced with the
    GPU in one untimed step, and the allocator's retries (a full cache freed: a sync each)."""

    losses: list[float]
    step_ms: list[float]
    host_ms: list[float]
    peak_bytes: int | None
    parts_ms: dict[str, float] | None = None
    host_syncs: dict[str, int] | None = None
    alloc_retries: int | None = None


# Parts that do not nest in each other (the routed experts nest in the MoE blocks).
TOP_LEVEL_PARTS = ("moe_block", "attention")


def train_run(
    model: torch.nn.Module,
    batches: torch.Tensor,
    warmup: int,
    lr: float,
    device: torch.device,
    breakdown: bool = False,
    optimizer: str = "torch",
) -> RunResult:
    """Train ``model`` from its current state with a fresh AdamW on ``batches [steps, M, B, S]``
    (on ``device``; ``M`` micro-batches per step, their gradients summed, each loss scaled by
    ``1 / M``): no host sync between steps. The first ``warmup`` steps are not timed; the last
    of them runs with PyTorch's sync debug mode on (:func:`step_parts.sync_sites`)."""
    from . import step_parts

    opt = make_optimizer(model, lr, device, optimizer)
    cuda = device.type == "cuda"
    marks = None
    if breakdown:
        marks = step_parts.PartMarks(step_parts.find_parts(model, moe_blocks(model)), cuda)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        retries0 = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    micro = batches.shape[1]
    losses, times, syncs = [], [], None

    def step(i: int) -> None:
        timed = marks is not None and i >= warmup
        if timed:
            marks.begin_step()
        opt.zero_grad(set_to_none=True)
        total = None
        for ids in batches[i]:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            (loss / micro).backward()
            total = loss.detach() / micro if total is None else total + loss.detach() / micro
        if timed:
            marks.optimizer_start()
        opt.step()
        if timed:
            marks.optimizer_end()
            marks.end_step()
        losses.append(total)

    try:
        for i in range(batches.shape[0]):
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            if cuda:
                start.record()
            h0 = time.perf_counter()
            if i == warmup - 1:
                syncs = step_parts.sync_sites(lambda: step(i))
            else:
                step(i)
            h1 = time.perf_counter()
            if cuda:
                end.record()
            if i >= warmup:
                times.append((start, end, h0, h1))
        if cuda:
            torch.cuda.synchronize(device)
        parts = marks.summary(TOP_LEVEL_PARTS) if marks is not None else None
    finally:
        if marks is not None:
            marks.remove()
    step_ms = [(s.elapsed_time(e) if cuda else (h1 - h0) * 1e3) for s, e, h0, h1 in times]
    host_ms = [(h1 - h0) * 1e3 for _, _, h0, h1 in times]
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    retries = None
    if cuda:
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries0
    opt.zero_grad(set_to_none=True)
    opt.state.clear()  # its moments go before the next run's optimizer is made
    if cuda:
        torch.cuda.empty_cache()  # the next run starts with the allocator's cache empty
    return RunResult(
        [float(x) for x in torch.stack(losses).cpu().tolist()],
        step_ms,
        host_ms,
        peak,
        parts_ms=parts,
        host_syncs=syncs,
        alloc_retries=retries,
    )


# ------------------------------------------------------------------------------------- facts


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def _slug(text: str) -> str:
    text = text.lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "unknown"


def default_out_path(gpu: str, commit: str, date: str) -> str:
    """benchmarks/results/train_<gpu>_<commit>_<date>.json (gpu e.g. "h200", or "cpu")."""
    gpu_slug = "cpu" if gpu.startswith("cpu") else _slug(gpu)
    return os.path.join("benchmarks", "results", f"train_{gpu_slug}_{commit}_{date[:10]}.json")


# ---------------------------------------------------------------------------------- the run


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _finish_record(rec: dict[str, Any], runs: list[RunResult], flops: float, peak: float) -> None:
    step_all = [ms for r in runs for ms in r.step_ms]
    host_all = [ms for r in runs for ms in r.host_ms]
    step_ms = _median(step_all)
    rec.update(
        step_ms=step_ms,
        step_ms_all=step_all,
        host_step_ms=_median(host_all),
        losses=runs[0].losses,
        deterministic=(all(r.losses == runs[0].losses for r in runs) if len(runs) > 1 else None),
    )
    peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
    rec["peak_mem_gb"] = max(peaks) / 1e9 if peaks else None
    parts = [r.parts_ms for r in runs if r.parts_ms]
    if parts:  # the median over the runs of each part's per-run median
        rec["breakdown_ms"] = {k: _median([p[k] for p in parts]) for k in parts[0]}
    rec["host_syncs"] = runs[0].host_syncs
    retries = [r.alloc_retries for r in runs if r.alloc_retries is not None]
    rec["alloc_retries"] = sum(retries) if retries else None
    if step_ms:
        rec["tokens_per_s_per_gpu"] = rec["tokens"] * rec["microbatches"] / (step_ms * 1e-3)
        rec["model_tflops"] = flops / (step_ms * 1e-3) / 1e12
        rec["mfu"] = rec["model_tflops"] / peak if peak else None


def add_speedups(records: list[dict[str, Any]]) -> None:
    """speedup_vs_native = native's step_ms / this step_ms (same model, routing, tokens, W)."""

    def key(r):
        return (r["model"], r["routing"], r["tokens"], r["world_size"], r["layers"])

    native = {key(r): r for r in records if r["impl"] == "native" and r.get("step_ms")}
    for r in records:
        base = native.get(key(r))
        if base is not None and r.get("step_ms"):
            r["speedup_vs_native"] = base["step_ms"] / r["step_ms"]


def _run_line(tag: str, impl: str, res: RunResult, tokens: int) -> str:
    med = _median(res.step_ms)
    rate = f"{tokens / (med * 1e-3):,.0f} tok/s" if med else "-"
    peak = f"  peak {res.peak_bytes / 1e9:.1f} GB" if res.peak_bytes is not None else ""
    line = (
        f"[{tag}] {impl:<18} {len(res.losses)} steps  step {med:.1f} ms (median of "
        f"{len(res.step_ms)})  host {_median(res.host_ms):.1f} ms  {rate}  loss "
        f"{res.losses[0]:.4f} -> {res.losses[-1]:.4f}{peak}"
    )
    if res.parts_ms:
        line += "\n    " + "  ".join(f"{k} {v:.1f} ms" for k, v in res.parts_ms.items())
    if res.host_syncs:
        sites = sorted(res.host_syncs.items(), key=lambda kv: -kv[1])
        line += "\n    host syncs in one step: " + ", ".join(f"{k} x{n}" for k, n in sites[:6])
    if res.alloc_retries:
        line += f"\n    allocator retries (cache freed): {res.alloc_retries}"
    return line


def _choose_layers(spec: TrainModel, opts: TrainOptions) -> tuple[int, MemoryEstimate]:
    """--layers, the tiny model's, or the most that fit (the estimate is printed)."""
    per_layer, fixed = layer_params(spec, opts.vocab_size, opts.seq_len, opts.dtype)
    sizes = dict(
        dtype_bytes=torch.tensor([], dtype=opts.dtype).element_size(),
        vocab_size=opts.vocab_size,
        microbatches=opts.microbatches,
        fp8=any(impl_precision(impl, opts) == "fp8" for impl in opts.impls),
    )
    layers = opts.layers or spec.default_layers
    if opts.device.type != "cuda":
        layers = layers or 2
        est = estimate_memory(spec, layers, opts.tokens, per_layer, fixed, **sizes)
        _log(f"[{spec.name}] memory estimate: {est.describe()}")
        return layers, est
    torch.cuda.empty_cache()
    budget = memory_budget(opts.device)
    if layers is None:
        est = fit_layers(spec, budget, opts.tokens, per_layer, fixed, **sizes)
        layers, how = est.layers, "fitted"
    else:
        est = estimate_memory(spec, layers, opts.tokens, per_layer, fixed, **sizes)
        how = "given"
    _log(
        f"[{spec.name}] memory estimate ({how}): {est.describe()}; budget "
        f"{budget / 1e9:.1f} GB free less the reserve"
    )
    if est.total_bytes > budget:
        _log(f"[{spec.name}] warning: the estimate exceeds the budget; the run may run out")
    return layers, est


def _base_record(
    spec: TrainModel,
    impl: str,
    routing: str,
    layers: int,
    opts: TrainOptions,
    facts: dict[str, Any],
) -> dict[str, Any]:
    rec: dict[str, Any] = dict.fromkeys(RECORD_FIELDS)
    rec.update(
        kind="train",
        model=spec.name,
        impl=impl,
        routing=routing,
        world_size=1,
        precision=impl_precision(impl, opts),
        layers=layers,
        tokens=opts.tokens,
        microbatches=opts.microbatches,
        optimizer=opts.optimizer,
        seq_len=opts.seq_len,
        batch_size=opts.batch_size,
        steps=opts.steps,
        warmup=opts.warmup,
        rounds=opts.rounds,
        lr=opts.lr,
        status="ok",
        note="",
        **facts,
    )
    return rec


def run_model(
    spec: TrainModel,
    opts: TrainOptions,
    facts: dict[str, Any],
    keys: dict[str, str | BaseException],
) -> list[dict[str, Any]]:
    """Every (routing, impl) of one model: build, snapshot, the runs in :func:`run_order`."""
    layers, estimate = _choose_layers(spec, opts)
    t0 = time.perf_counter()
    model = build_model(spec, layers, opts)
    counts = count_params(model)
    flops = opts.microbatches * flops_per_step(
        counts.active, spec, layers, opts.batch_size, opts.seq_len
    )
    state = snapshot(model)
    steps = opts.warmup + opts.steps
    batches = make_batches(
        steps * opts.microbatches, opts.batch_size, opts.seq_len, opts.vocab_size, opts.seed
    )
    batches = batches.view(steps, opts.microbatches, *batches.shape[1:]).to(opts.device)
    _log(
        f"[{spec.name}] built {layers} layers, {_count(counts.total)} params "
        f"({_count(counts.active)} active per token), {flops / 1e12:.3g} TFLOP per step, "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    records = []
    for routing in opts.routings:
        install_routing(model, routing)
        recs = {impl: _base_record(spec, impl, routing, layers, opts, facts) for impl in opts.impls}
        results: dict[str, list[RunResult]] = {impl: [] for impl in opts.impls}
        for impl, rec in recs.items():
            rec.update(
                flops_per_step=flops,
                active_params=counts.active,
                params=counts.total,
                estimated_mem_gb=estimate.total_bytes / 1e9,
            )
            key = keys[impl]
            ok, reason = impl_status(impl, opts.device)
            if isinstance(key, BaseException):
                rec.update(status="skipped", note=str(key)[:300])
            elif not ok:
                rec.update(status="skipped", note=reason[:300])
            else:
                rec["experts_implementation"] = key
        for rnd, impl in run_order(opts.impls, opts.rounds):
            rec = recs[impl]
            if rec["status"] != "ok":
                continue
            tag = f"{spec.name} {routing} {rnd + 1}/{opts.rounds}"
            try:
                restore(model, state)
                model.set_experts_implementation(rec["experts_implementation"])
                res = train_run(
                    model,
                    batches,
                    opts.warmup,
                    opts.lr,
                    opts.device,
                    breakdown=opts.breakdown,
                    optimizer=opts.optimizer,
                )
            except Exception as exc:  # record it, go on with the others
                note = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                rec.update(status="error", note=note)
                _log(f"[{tag}] {impl}: error: {note}")
                for p in model.parameters():
                    p.grad = None
                if opts.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            results[impl].append(res)
            _log(_run_line(tag, impl, res, opts.tokens_per_step))
        for impl, rec in recs.items():
            if rec["status"] == "ok" and results[impl]:
                _finish_record(rec, results[impl], flops, facts["dense_tflops"])
            records.append(rec)
        install_routing(model, "learned")
    del model, state, batches
    if opts.device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def _resolve_keys(impls: Sequence[str], device: torch.device) -> dict[str, str | BaseException]:
    keys: dict[str, str | BaseException] = {}
    for impl in impls:
        try:
            keys[impl] = experts_key(impl)
        except Exception as exc:
            keys[impl] = exc
            _log(f"warning: {impl} cannot run: {exc}")
    if device.type == "cuda" and any(IMPLS[i] is not None for i in impls):
        _device_checks_only()
    return keys


def _device_checks_only() -> None:
    """megamoe's input checks that read device values sync with the host in every layer; on a
    GPU the Triton backends check on the device, so the benchmark turns the host ones off
    (``set_check_values(False)`` of the integration, where it has it), as a training loop
    that does not want a sync per layer would."""
    try:
        from ..integrations import transformers as hf_integration
    except ImportError:
        return
    set_check_values = getattr(hf_integration, "set_check_values", None)
    if set_check_values is not None:
        set_check_values(False)


def run_train_bench(opts: TrainOptions) -> list[dict[str, Any]]:
    """Every model x routing x impl of ``opts``; returns the records (with speedups)."""
    from .bench import git_commit, measure_gemm_peak
    from .harness import DistEnv

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise NotImplementedError(
            "train-bench runs on one GPU for now (W = 1): expert parallelism needs the model "
            "built with transformers' DistributedConfig(ep_size=W) and megamoe's expert-parallel "
            "implementation"
        )
    if opts.device.type == "cuda":
        torch.cuda.set_device(opts.device)
    keys = _resolve_keys(opts.impls, opts.device)
    dense = measure_gemm_peak(DistEnv(device=opts.device))
    _log(f"dense bf16 GEMM: {dense:.1f} TFLOP/s")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    facts = {
        "gpu": gpu_name(opts.device),
        "commit": git_commit(),
        "date": now,
        "dense_tflops": dense,
        **_versions(),
    }
    records = []
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if opts.deterministic_algorithms:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for name in opts.models:
            records += run_model(MODELS[name], opts, facts, keys)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    for r in records:
        r["deterministic_algorithms"] = opts.deterministic_algorithms
    add_speedups(records)
    return records


# --------------------------------------------------------------------------------- reporting


def summary_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records' headline columns (what the stdout table shows)."""
    rows = []
    for r in records:
        losses = r.get("losses") or []
        rows.append(
            {
                "model": r["model"],
                "routing": r["routing"],
                "impl": r["impl"],
                "precision": r["precision"],
                "layers": r["layers"],
                "tokens/step": r["tokens"] * (r.get("microbatches") or 1),
                "step ms": r.get("step_ms"),
                "host ms": r.get("host_step_ms"),
                "tokens/s/GPU": None
                if r.get("tokens_per_s_per_gpu") is None
                else round(r["tokens_per_s_per_gpu"]),
                "MFU %": None if r.get("mfu") is None else 100 * r["mfu"],
                "vs native": None
                if r.get("speedup_vs_native") is None
                else f"{r['speedup_vs_native']:.3f}x",
                "peak GB": r.get("peak_mem_gb"),
                "loss first": losses[0] if losses else None,
                "loss last": losses[-1] if losses else None,
                "same losses": r.get("deterministic"),
                "status": r["status"] if r["status"] == "ok" else f"{r['status']}: {r['note']}",
            }
        )
    return rows


def format_summary(records: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    from .report import format_generic_table

    if not records:
        return "(no records)"
    first = records[0]
    head = (
        f"gpu: {first['gpu']}   commit: {first['commit']}   date: {first['date']}   "
        f"dense bf16 GEMM: {first['dense_tflops']:.1f} TFLOP/s   "
        f"steps: {first['steps']} timed after {first['warmup']}, {first['rounds']} round(s)"
    )
    return head + "\n" + format_generic_table(summary_rows(records), markdown=markdown)


def run_failed(records: Sequence[dict[str, Any]]) -> bool:
    return any(r.get("status") == "error" for r in records)


# --------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "--models",
        dest="models",
        nargs="+",
        choices=list(MODELS),
        default=None,
        help=f"models (default: {' '.join(BENCH_MODELS)}; the -tiny ones run on the CPU)",
    )
    p.add_argument(
        "--impls",
        "--impl",
        dest="impls",
        nargs="+",
        choices=list(IMPLS),
        default=None,
        help=f"MoE implementations (default on a GPU: {' '.join(GPU_DEFAULT_IMPLS)}; "
        f"tiny / CPU: {' '.join(CPU_DEFAULT_IMPLS)})",
    )
    p.add_argument(
        "--routing",
        choices=list(ROUTING_CHOICES),
        default="both",
        help="learned (the model's router), balanced (forced round robin, weights 1/K) or both "
        "(default)",
    )
    p.add_argument("--layers", type=int, help="layers (default: as many as fit, estimated)")
    p.add_argument(
        "--tokens", type=int, help="tokens per step and GPU, batch x seq (default 4096; tiny 64)"
    )
    p.add_argument("--seq", type=int, dest="seq_len", help="sequence length (default 4096)")
    p.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="micro-batches of --tokens per optimizer step, gradients accumulated (default 1)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="torch",
        help="torch: torch's fused AdamW for every parameter (default); megamoe: "
        "megamoe.optim.AdamW for the parameters of at least 2^20 elements, torch's for the rest; "
        "megamoe-copies: also the fp8 layers' expert weights, whose update writes their fp8 "
        "copies (the forward quantizes nothing; slower on an H100 than the forward's pass)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="time each step's parts: routed experts, MoE blocks, attention, optimizer, rest "
        "(marks on the modules in every timed step; megamoe.tools.step_parts)",
    )
    p.add_argument(
        "--deterministic-algorithms",
        action="store_true",
        help="torch.use_deterministic_algorithms(True) for every run, so that a second round "
        "can repeat the first bit for bit (slower native parts)",
    )
    p.add_argument("--steps", type=int, help="timed steps per run (default 30; tiny 3)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 5; tiny 1)")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs per impl, each from the same start, the order reversed each round (default 2)",
    )
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW lr (default {DEFAULT_LR})")
    p.add_argument("--vocab", type=int, dest="vocab_size", help="vocabulary (default 32768)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument(
        "--tiny",
        action="store_true",
        help="tiny models in float32, native and megamoe-reference, 3 steps (the default "
        "without a GPU)",
    )
    p.add_argument(
        "--out",
        help="JSON records (default benchmarks/results/train_<gpu>_<commit>_<date>.json)",
    )


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    routings = list(ROUTINGS) if args.routing == "both" else [args.routing]
    return TrainOptions(
        models=list(args.models or BENCH_MODELS),
        impls=args.impls,
        routings=routings,
        layers=args.layers,
        tokens=args.tokens,
        microbatches=args.microbatches,
        optimizer=args.optimizer,
        breakdown=args.breakdown,
        deterministic_algorithms=args.deterministic_algorithms,
        seq_len=args.seq_len,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        lr=args.lr,
        vocab_size=args.vocab_size,
        seed=args.seed,
        tiny=args.tiny,
    )


def cmd_train_bench(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    if opts.tiny and not args.tiny:
        _log("no GPU: the tiny models in float32 (a smoke test, not a measurement)")
    records = run_train_bench(opts)
    print(format_summary(records))
    first = records[0] if records else {}
    out = args.out or default_out_path(
        first.get("gpu", "unknown"), first.get("commit", "unknown"), first.get("date", "")
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    print(f"\nwrote {len(records)} records to {out}")
    return 1 if run_failed(records) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megamoe train-bench", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_train_bench(args)
    except (TypeError, ValueError) as exc:
        print(f"megamoe train-bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
