"""megamoe inside Hugging Face transformers (megamoe.integrations.transformers), on the CPU.

Tiny Qwen3-MoE and DeepSeek-V3 models in float32 with eager attention: megamoe's reference
backend trains them like transformers' own grouped_mm experts, takes gate_up_proj without a
copy, refuses layouts it cannot take, and with expert parallelism over gloo ranks
(ep_implementation="megamoe") equals one process.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import megamoe.functional as functional  # noqa: E402
import megamoe.integrations.transformers as mt  # noqa: E402
from integrations.transformers_models import (  # noqa: E402
    build,
    experts_modules,
    token_ids,
    train,
    twin,
)
from support.procs import run_gloo  # noqa: E402

STEPS = 20
EP_STEPS = 4
REF = mt.experts_implementation("reference")


class _CountCalls:
    """Wraps megamoe.functional.forward (what megamoe's op runs) to count the calls and keep
    the weights and group each call received."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        inner = functional.forward

        def forward(x, topk_ids, topk_weights, weights, config, **kw):
            self.calls.append((weights, config, kw.get("group"), kw.get("backend")))
            return inner(x, topk_ids, topk_weights, weights, config, **kw)

        monkeypatch.setattr(functional, "forward", forward)


def test_keys_and_versions():
    from transformers.integrations.moe import ExpertsInterface

    keys = {b: mt.experts_implementation(b) for b in mt.BACKENDS}
    assert keys == {
        "auto": "megamoe",
        "triton": "megamoe_triton",
        "fused": "megamoe_fused",
        "reference": "megamoe_reference",
    }
    assert mt.experts_implementation() == "megamoe"
    registered = ExpertsInterface()
    for key in keys.values():
        assert key in registered
    assert "deepgemm_megamoe" not in keys.values()
    fp8 = {b: mt.experts_implementation(b, "fp8") for b in mt.BACKENDS}
    assert fp8 == {
        "auto": "megamoe_fp8",
        "triton": "megamoe_triton_fp8",
        "fused": "megamoe_fused_fp8",
        "reference": "megamoe_reference_fp8",
    }
    for key in fp8.values():
        assert key in registered
    with pytest.raises(ValueError, match=r"precision must be one of \['bf16', 'fp8'\], got 'fp4'"):
        mt.experts_implementation("auto", "fp4")
    with pytest.raises(ValueError, match=re.escape("backend must be one of")) as err:
        mt.experts_implementation("cuda")
    assert "'cuda'" in str(err.value)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        mt.set_check_values("no")

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    assert mt.SUPPORTS_EXPERT_PARALLEL == ((major, minor) >= (5, 23))
    if mt.SUPPORTS_EXPERT_PARALLEL:
        from transformers.distributed.expert_parallel import EPImplementationInterface

        assert EPImplementationInterface()[mt.EP_IMPLEMENTATION] is mt.MegaMoEExpertParallel


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_training_matches_grouped_mm(name, monkeypatch):
    model = build(name)
    native, mega = twin(model, "grouped_mm"), twin(model, REF)
    assert mega.config._experts_implementation == REF
    assert native.config._experts_implementation == "grouped_mm"
    assert list(mega.state_dict()) == list(model.state_dict()) == list(native.state_dict())
    ids = token_ids(4, 32)

    calls = _CountCalls(monkeypatch)
    mega_losses = train(mega, ids, STEPS)
    layers = len(experts_modules(mega))
    assert len(calls.calls) == STEPS * layers  # every MoE layer of every step ran megamoe
    assert {c[3] for c in calls.calls} == {"reference"}
    native_losses = train(native, ids, STEPS)
    assert len(calls.calls) == STEPS * layers  # and the native run did not

    assert native_losses[-1] < 0.8 * native_losses[0]  # the steps change the model
    for step, (a, b) in enumerate(zip(mega_losses, native_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: megamoe {a} vs grouped_mm {b}"


def test_fp8_key_trains_in_the_fp8_recipe(monkeypatch):
    """ "megamoe_reference_fp8" runs every MoE layer with MoEConfig(precision="fp8"): losses close
    to the bf16-recipe key's (float32 model) but not equal (the operands are quantized), and the
    same bits run to run."""
    model = build("qwen3_moe")
    key = mt.experts_implementation("reference", "fp8")
    ids = token_ids(4, 32)
    calls = _CountCalls(monkeypatch)
    fp8_losses = train(twin(model, key), ids, STEPS)
    assert len(calls.calls) == STEPS * len(experts_modules(model))
    # (unsharded parameters: their fp8 copies are cached; FSDP-sharded ones would not be)
    assert {(c[1].precision, c[1].fp8_weight_cache, c[3]) for c in calls.calls} == {
        ("fp8", True, "reference")
    }
    assert train(twin(model, key), ids, STEPS) == fp8_losses
    ref_losses = train(twin(model, REF), ids, STEPS)
    assert fp8_losses != ref_losses
    for step, (a, b) in enumerate(zip(fp8_losses, ref_losses)):
        assert abs(a - b) <= 5e-3 * abs(b), f"step {step}: fp8 {a} vs bf16 recipe {b}"


def test_gate_up_gradient_without_copy(monkeypatch):
    model = build("qwen3_moe")
    native, mega = twin(model, "grouped_mm"), twin(model, REF)
    ids = token_ids(2, 32)
    calls = _CountCalls(monkeypatch)
    mega(input_ids=ids, labels=ids).loss.backward()
    native(input_ids=ids, labels=ids).loss.backward()

    layers = experts_modules(mega)
    assert len(calls.calls) == len(layers)
    for (weights, config, group, _), experts, ref in zip(
        calls.calls, layers, experts_modules(native)
    ):
        gate_up, down = experts.gate_up_proj, experts.down_proj
        e, two_i, h = gate_up.shape
        assert (config.num_experts, config.intermediate_size, config.hidden_size) == (
            e,
            two_i // 2,
            h,
        )
        assert group is None
        # the op got gate_up_proj itself: its gate and up inputs are views of that parameter
        assert weights.w_gate._base is gate_up and weights.w_up._base is gate_up
        assert weights.w_up.data_ptr() == gate_up.data_ptr() + (two_i // 2) * h * 4
        assert weights.w_down is down
        assert gate_up.grad.shape == (e, two_i, h)
        torch.testing.assert_close(gate_up.grad, ref.gate_up_proj.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(down.grad, ref.down_proj.grad, rtol=1e-4, atol=1e-7)
        assert gate_up.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "flag, value",
    [
        ("has_gate", False),
        ("is_concatenated", False),
        ("is_transposed", True),
        ("has_bias", True),
        ("has_post_expert_norm", True),
    ],
)
def test_refuses_layout(flag, value):
    model = twin(build("qwen3_moe"), REF)
    setattr(experts_modules(model)[0], flag, value)
    ids = token_ids(1, 8)
    expected = f"Qwen3MoeExperts.{flag} is {value}, expected {not value}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        model(input_ids=ids)


def test_refuses_activation_gate_and_shapes():
    ids = token_ids(1, 8)
    model = twin(build("qwen3_moe"), REF)
    experts = experts_modules(model)[0]

    experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match=re.escape("Qwen3MoeExperts.act_fn must be SiLU")):
        model(input_ids=ids)
    experts.act_fn = torch.nn.SiLU()
    model(input_ids=ids)  # nn.SiLU is SiLU too

    def clamped(self, gate_up):
        gate, up = gate_up.clamp(max=7.0).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    cls = type(experts)
    experts.__class__ = type("ClampedExperts", (cls,), {"_apply_gate": clamped})
    with pytest.raises(ValueError, match="ClampedExperts defines its own _apply_gate"):
        model(input_ids=ids)
    experts.__class__ = cls

    e, two_i, h = experts.gate_up_proj.shape
    experts.down_proj = torch.nn.Parameter(torch.zeros(e, two_i // 2, h))
    with pytest.raises(ValueError, match=re.escape(f"down_proj must be [{e}, {h}, {two_i // 2}]")):
        model(input_ids=ids)


@pytest.mark.parametrize(
    "split, how",
    [
        ({"_is_expert_parallel": True}, "sharded between expert-parallel ranks"),
        ({"tp_size": 2, "ep_size": 1}, "DistributedConfig(tp_size=2)"),
        ({"enable_expert_parallel": True, "tp_size": 2}, "enable_expert_parallel=True"),
    ],
)
def test_refuses_experts_split_between_ranks(split, how):
    """Under transformers' tensor or expert parallelism the experts keys refuse to run (the
    ids would be local or masked): expert parallelism goes through ep_implementation="megamoe".
    """
    model = twin(build("qwen3_moe"), REF)
    experts = experts_modules(model)[0]
    if "_is_expert_parallel" in split:
        experts._is_expert_parallel = True
    else:  # what from_pretrained(distributed_config=...) leaves on the config
        model.config.distributed_config = SimpleNamespace(**split)
    hidden = experts.gate_up_proj.shape[2]
    args = (torch.zeros(3, hidden), torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5))
    with pytest.raises(ValueError, match=re.escape(how)) as err:
        experts(*args)
    assert "ep_implementation='megamoe'" in str(err.value)
    assert "experts_implementation='megamoe_reference'" in str(err.value)


def test_refuses_gpt_oss():
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        attn_implementation="eager",
    )
    model = AutoModelForCausalLM.from_config(cfg)
    model.set_experts_implementation(REF)
    with pytest.raises(ValueError, match=re.escape("GptOssExperts.is_concatenated is False")):
        model(input_ids=token_ids(1, 8))


# Expert parallelism: two gloo ranks, each its half of the batch, against one process.


def _train_ranks(model, ids, rank, world, want_losses, want_grads) -> None:
    """EP_STEPS steps on this rank's rows of ``ids``; the first step's gradients and every
    step's loss (the mean over the ranks) must be those of one process on all of ``ids``."""
    import torch.distributed as dist

    rows = ids.shape[0] // world
    mine = ids[rank * rows : (rank + 1) * rows]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(EP_STEPS):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        if step == 0:
            for key, p in model.named_parameters():
                assert p.grad is not None, f"{key} got no gradient"
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                torch.testing.assert_close(grad, want_grads[key], rtol=1e-4, atol=1e-7, msg=key)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    for step, (a, b) in enumerate(zip(losses, want_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {world} ranks {a} vs one process {b}"


def _ep_rank(rank, world, path, name, ids, want_losses, want_grads):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    seen = []
    inner = functional.forward

    def forward(x, topk_ids, topk_weights, weights, config, **kw):
        assert kw.get("backend") == "reference"  # the backend the experts key names
        seen.append((kw.get("group"), weights.w_gate.shape[0], config.num_experts))
        return inner(x, topk_ids, topk_weights, weights, config, **kw)

    functional.forward = forward

    def load(**distributed):
        return AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.float32,
            attn_implementation="eager",
            experts_implementation=REF,
            distributed_config=DistributedConfig(**distributed),
        )

    model = load(fsdp_size=world, ep_size=world, ep_implementation=mt.EP_IMPLEMENTATION)
    _train_ranks(model, ids, rank, world, want_losses, want_grads)
    cfg = model.config
    e_global = cfg.num_experts if name == "qwen3_moe" else cfg.n_routed_experts
    calls = EP_STEPS * len(experts_modules(model))
    assert len(seen) == calls  # megamoe ran every MoE layer of every step, over the EP group
    assert all(g is not None and dist.get_world_size(g) == world for g, _, _ in seen)
    assert {(e, n) for _, e, n in seen} == {(e_global // world, e_global)}
    if name != "qwen3_moe":
        return

    # FSDP alone: the experts key on whole experts in each rank (no group)
    seen.clear()
    _train_ranks(load(fsdp_size=world), ids, rank, world, want_losses, want_grads)
    assert len(seen) == calls
    assert {(g, e, n) for g, e, n in seen} == {(None, e_global, e_global)}

    # a tensor-parallel group is refused by name
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    experts = experts_modules(build(name))[0]
    with pytest.raises(ValueError, match=f"needs tp_size 1.*group of {world} ranks"):
        mt.MegaMoEExpertParallel(experts, mesh, mesh)


@pytest.mark.skipif(
    not mt.SUPPORTS_EXPERT_PARALLEL,
    reason=f"transformers {transformers.__version__} has no EPImplementationInterface (5.23+)",
)
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_equals_one_process(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = build(name)
    model.save_pretrained(tmp_path)
    ids = token_ids(4, 16)
    one = twin(model, REF)
    one(input_ids=ids, labels=ids).loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in one.named_parameters()}
    losses = train(twin(model, REF), ids, EP_STEPS)
    run_gloo(2, _ep_rank, str(tmp_path), name, ids, losses, grads)


def test_docs_example_runs_as_written(capsys):
    """docs/transformers.md's one-process example (the CPU one), executed."""
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"
    text = doc.read_text().split("## Example (one process)", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'set_experts_implementation(mt.experts_implementation("reference"))' in code
    exec(compile(code, str(doc), "exec"), {"__name__": "docs_example"})
    lines = capsys.readouterr().out.split("\n")
    losses = [float(line.split()[1]) for line in lines if line.strip()]
    assert len(losses) == 3 and all(2.0 < x < 10.0 for x in losses), lines
    assert losses[-1] < losses[0]  # it trains
