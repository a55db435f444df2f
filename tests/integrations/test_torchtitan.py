"""megamoe inside torchtitan 0.3.0 (megamoe.integrations.torchtitan), on the CPU.

The real config-registry entries ``qwen3_moe_debug`` and ``deepseek_v3_debugmodel``: the
overrides swap the nodes and keep every state-dict key; the MoE layer's forward and every
gradient equal the native layer's (its experts run in float32 here, one expert at a time); the
full model's logits too (forward only: FlexAttention has no CPU backward); the layer compiles
in one graph; the balancing hook still moves the expert bias; selective AC keeps megamoe's
forward; and with torchtitan's own mesh and parallelize over two gloo ranks (EP=2), the layer
equals one process.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.config.manager import ConfigManager
from torchtitan.config.override import apply_overrides
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.moe import GroupedExperts

import megamoe.functional as functional
from integrations.torchtitan_models import (
    FP32,
    REGISTRY,
    ROUTED,
    SAC,
    WHOLE_MOE,
    apply,
    float32_native,
    grads,
    local,
    moe_layers,
    moe_pair,
    trainer_config,
)
from megamoe.backends.fp8_weights import gathered_per_call
from megamoe.integrations.torchtitan import (
    MegaMoEMoE,
    MegaMoERoutedExperts,
    MegaMoESelectiveAC,
)
from support.oracle import rel_err
from support.procs import run_gloo

MODELS = sorted(REGISTRY)
OVERRIDES = [ROUTED, WHOLE_MOE]
# float32 on both sides; only the summation order differs
TOL = 1e-5


@pytest.fixture
def calls(monkeypatch):
    """The megamoe calls of a test (what megamoe's custom op runs): each call's weights."""
    seen: list = []
    real = functional.forward

    def counting(x, topk_ids, topk_weights, weights, *args, **kwargs):
        seen.append(weights)
        return real(x, topk_ids, topk_weights, weights, *args, **kwargs)

    monkeypatch.setattr(functional, "forward", counting)
    return seen


def _inputs(module, batch: int = 2, seq: int = 24, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    dim = module.router.gate.in_features
    return torch.randn(batch, seq, dim, generator=g), torch.randn(batch, seq, dim, generator=g)


def _run(module, x, dy):
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * dy).sum().backward()
    return y.detach(), x.grad


# -- the override: nodes, keys, FLOPs -------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_override_swaps_the_nodes_and_keeps_keys_and_flops(name):
    native, mega = trainer_config(name), trainer_config(name)
    before = [moe.routed_experts for _, moe in moe_layers(mega.model_spec.model)]
    lines = apply(mega, [f'{ROUTED}={{"backend":"fused","ring_rows":2048}}'])
    layers = moe_layers(mega.model_spec.model)
    assert len(lines) == len(layers) == len(before) > 0
    for (i, moe), old in zip(layers, before):
        new = moe.routed_experts
        assert type(new) is MegaMoERoutedExperts.Config, i
        assert new.sharding_config is old.sharding_config is not None
        assert new.inner_experts is old.inner_experts and new.param_init is old.param_init
        assert new.backend == "fused" and new.tunables == {"ring_rows": 2048}
    with torch.device("meta"):
        a, b = native.model_spec.model.build(), mega.model_spec.model.build()
    b.verify_module_protocol()
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(sa[k].shape == sb[k].shape for k in sa)
    for i, _ in layers:
        moe_a, moe_b = a.layers[str(i)].moe, b.layers[str(i)].moe
        assert type(moe_b.routed_experts) is MegaMoERoutedExperts
        assert type(moe_b.routed_experts.inner_experts) is GroupedExperts
        assert type(moe_b.routed_experts.token_dispatcher) is type(
            moe_a.routed_experts.token_dispatcher
        )
    seq = native.training.seq_len
    assert native.model_spec.model.get_nparams_and_flops(
        a, seq
    ) == mega.model_spec.model.get_nparams_and_flops(b, seq)


def test_cli_form_and_cuda_graph_validation(capsys):
    """``--override.imports`` as torchtitan's own CLI parses it, with two overrides; with EP > 1
    torchtitan's CUDA-graph check wants --training.disable_cuda_graphs."""
    args = [
        "--module",
        "deepseek_v3",
        "--config",
        "deepseek_v3_debugmodel",
        "--override.imports",
        f'{ROUTED}={{"backend":"reference","compute_dtype":"float32"}}',
        SAC,
    ]
    cfg = ConfigManager().parse_args(args)
    cfg.model_spec.model.update_from_config(config=cfg)
    lines = apply_overrides(cfg.override, cfg)
    assert len(lines) == len(moe_layers(cfg.model_spec.model)) + 1
    assert type(cfg.activation_checkpoint) is MegaMoESelectiveAC.Config
    for _, moe in moe_layers(cfg.model_spec.model):
        assert moe.routed_experts.backend == "reference"
    cfg._validate_cuda_graphs()  # EP = 1: nothing to refuse

    ep = ["--parallelism.expert_parallel_degree", "2"]
    with pytest.raises(SystemExit):  # the CLI parser reports torchtitan's ValueError
        ConfigManager().parse_args(args + ep)
    assert "--training.disable_cuda_graphs" in capsys.readouterr().err
    cfg = ConfigManager().parse_args(args + ep + ["--training.disable_cuda_graphs"])
    cfg.model_spec.model.update_from_config(config=cfg)
    apply_overrides(cfg.override, cfg)
    cfg._validate_cuda_graphs()


# -- the layer: forward, backward, dtype -----------------------------------------------------------


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("name", MODELS)
def test_moe_layer_matches_native_forward_and_every_gradient(name, override, calls):
    native, mega = moe_pair(name, override)
    assert type(mega.routed_experts) is MegaMoERoutedExperts
    assert (type(mega) is MegaMoEMoE) == (override == WHOLE_MOE)
    x, dy = _inputs(native)
    ya, dxa = _run(native, x, dy)
    assert not calls  # the native layer never calls megamoe
    yb, dxb = _run(mega, x, dy)
    assert len(calls) == 1
    fused_shared = override == WHOLE_MOE and native.shared_experts is not None
    assert calls[0].has_shared == fused_shared
    assert yb.shape == ya.shape and yb.dtype == ya.dtype == torch.float32
    assert rel_err(yb, ya) < TOL
    assert rel_err(dxb, dxa) < TOL
    ga, gb = grads(native), grads(mega)
    assert list(ga) == list(gb) and len(ga) >= 4  # experts, router (and the shared expert)
    for n in ga:
        assert rel_err(gb[n], ga[n]) < TOL, n
    assert torch.equal(mega.tokens_per_expert_E, native.tokens_per_expert_E)
    # checkpoints load both ways: megamoe's state dict into a native layer
    back, _ = moe_pair(name, override, seed=1)
    back.load_state_dict(mega.state_dict(), strict=True)
    yc, _ = _run(back, x, dy)
    assert torch.equal(yc, ya)


@pytest.mark.parametrize("override", OVERRIDES)
def test_fp8_option_runs_the_fp8_recipe(override, monkeypatch):
    """``precision="fp8"`` (a MoEConfig field, passed like any tunable) reaches megamoe: the
    layer runs the block-scaled recipe, close to the float32 layer but not equal to it."""
    seen = []
    real = functional.forward

    def recording(x, topk_ids, topk_weights, weights, config, *args, **kwargs):
        seen.append((config.precision, config.fp8_weight_cache))
        return real(x, topk_ids, topk_weights, weights, config, *args, **kwargs)

    monkeypatch.setattr(functional, "forward", recording)
    name = "deepseek_v3_debugmodel"
    native, mega = moe_pair(name, override, options={**FP32, "precision": "fp8"})
    assert mega.routed_experts.megamoe_config().precision == "fp8"
    x, dy = _inputs(native)
    ya, dxa = _run(native, x, dy)
    yb, dxb = _run(mega, x, dy)
    assert seen == [("fp8", True)]  # (float32 weights computed in float32: cached)
    assert 0 < rel_err(yb, ya) < 0.1 and 0 < rel_err(dxb, dxa) < 0.1
    ga, gb = grads(native), grads(mega)
    for n in ga:
        assert rel_err(gb[n], ga[n]) < 0.1, n


def test_fp8_weights_cast_for_each_call_are_not_cached(monkeypatch):
    """float32 parameters computed in bfloat16 are cast anew in every call: their fp8 copies are
    not cached (``fp8_weight_cache`` False), where each cast would add an entry; nor are
    FSDP-sharded ones (``fully_shard`` on ``inner_experts``: the gloo test below)."""
    seen = []
    real = functional.forward

    def recording(x, topk_ids, topk_weights, weights, config, *args, **kwargs):
        seen.append(config.fp8_weight_cache)
        return real(x, topk_ids, topk_weights, weights, config, *args, **kwargs)

    monkeypatch.setattr(functional, "forward", recording)
    _, mega = moe_pair("deepseek_v3_debugmodel", OVERRIDES[0], options={"precision": "fp8"})
    assert mega.routed_experts.inner_experts.w1_EFD.dtype == torch.float32
    x, dy = _inputs(mega)
    _run(mega, x, dy)
    assert seen == [False]
    assert mega.routed_experts.megamoe_config().fp8_weight_cache


def test_bfloat16_default_matches_native_bfloat16_experts():
    """The default compute dtype is GroupedExperts' (bfloat16); float32 in and out."""
    name = "deepseek_v3_debugmodel"
    cfg = trainer_config(name)
    apply(cfg, [(ROUTED, {"backend": "reference"})])
    (i, moe_cfg), *_ = moe_layers(cfg.model_spec.model)
    native_cfg = trainer_config(name)  # the native experts as shipped (bfloat16 grouped GEMMs)
    torch.manual_seed(0)
    native = native_cfg.model_spec.model.layers[i].moe.build()
    native.init_states()
    mega = moe_cfg.build()
    mega.load_state_dict(native.state_dict())
    assert mega.routed_experts.compute_dtype == torch.bfloat16
    x, dy = _inputs(native)
    ya, dxa = _run(native, x, dy)
    yb, dxb = _run(mega, x, dy)
    assert yb.dtype == torch.float32
    assert rel_err(yb, ya) < 5e-3 and rel_err(dxb, dxa) < 5e-3
    ga, gb = grads(native), grads(mega)
    for n in ga:
        assert rel_err(gb[n], ga[n]) < 2e-2, n


def test_triton_backend_forward_in_the_interpreter():
    """backend="triton" (its kernels in Triton's interpreter on the CPU) through the module."""
    name = "deepseek_v3_debugmodel"
    _, ref = moe_pair(name, ROUTED, {"backend": "reference"})
    _, tri = moe_pair(name, ROUTED, {"backend": "triton"})
    x, _ = _inputs(ref, batch=1, seq=16)
    with torch.no_grad():
        y_ref, y_tri = ref(x), tri(x)
    assert rel_err(y_tri, y_ref) < 1e-2


# -- the model ---------------------------------------------------------------------------------


def test_model_logits_match_native_forward_only():
    name, layers = "deepseek_v3_debugmodel", 3  # one dense block, then two MoE blocks
    native_cfg = trainer_config(name, layers=layers)
    float32_native(native_cfg)
    torch.manual_seed(0)
    native = native_cfg.model_spec.model.build()
    native.init_states()
    tokens = torch.randint(0, native_cfg.model_spec.model.vocab_size, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    mask = create_block_mask(lambda b, h, q, k: q >= k, 2, None, 32, 32, device="cpu")
    with torch.no_grad():
        expected = native(tokens, positions, mask)
        for override in OVERRIDES:
            cfg = trainer_config(name, layers=layers)
            apply(cfg, [(override, FP32)])
            model = cfg.model_spec.model.build()
            model.load_state_dict(native.state_dict(), strict=True)
            got = model(tokens, positions, mask)
            assert type(model.layers["1"].moe.routed_experts) is MegaMoERoutedExperts
            assert got.shape == expected.shape
            assert rel_err(got, expected) < TOL, override


# -- compile, balancing, activation checkpointing ------------------------------------------------


@pytest.mark.parametrize("override", OVERRIDES)
def test_compiled_layer_fullgraph_equals_eager(override, calls):
    _, mega = moe_pair("deepseek_v3_debugmodel", override)
    x, dy = _inputs(mega)
    y, dx = _run(mega, x, dy)
    g = grads(mega)
    mega.zero_grad(set_to_none=True)
    del calls[:]
    compiled = torch.compile(mega, fullgraph=True, backend="aot_eager")
    yc, dxc = _run(compiled, x, dy)
    assert len(calls) == 1  # megamoe's op ran inside the compiled graph
    assert torch.equal(yc, y) and torch.equal(dxc, dx)
    gc = grads(mega)
    for n in g:
        assert torch.equal(gc[n], g[n]), n


class _Block(nn.Module):
    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe_enabled = True
        self.moe = moe


class _Part(nn.Module):
    """What torchtitan's balancing hook walks: ``layers`` -> blocks with ``moe``."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(moe)})


class _Optimizers:
    def __init__(self):
        self.hooks = []

    def register_step_pre_hook(self, hook):
        self.hooks.append(hook)

    def step(self):
        for hook in self.hooks:
            hook(self, (), {})


@pytest.mark.parametrize("override", OVERRIDES)
def test_load_balancing_hook_moves_the_expert_bias(override):
    native, mega = moe_pair("deepseek_v3_debugmodel", override)
    one_process = types.SimpleNamespace(get_optional_mesh=lambda name: None, ep_enabled=False, tp=1)
    opts = {}
    for key, m in (("native", native), ("mega", mega)):
        opts[key] = _Optimizers()
        register_moe_load_balancing_hook(opts[key], [_Part(m)], one_process)
        assert len(opts[key].hooks) == 1
    x, _ = _inputs(native)
    for m in (native, mega):
        m.train()
        with torch.no_grad():
            m(x)
    counts = mega.tokens_per_expert_E.clone()
    assert counts.sum() == x.shape[0] * x.shape[1] * mega.router.top_k
    assert torch.equal(counts, native.tokens_per_expert_E)
    for key in opts:
        opts[key].step()
    assert torch.count_nonzero(mega.expert_bias_E) > 0
    assert torch.equal(mega.expert_bias_E, native.expert_bias_E)
    assert torch.count_nonzero(mega.tokens_per_expert_E) == 0
    mega.eval()
    with torch.no_grad():
        mega(x)
    assert torch.count_nonzero(mega.tokens_per_expert_E) == 0  # counted in training only


@pytest.mark.parametrize(
    "policy, megamoe_runs",
    [(MegaMoESelectiveAC, 1), (SelectiveAC, 2), (FullAC, 2)],
    ids=["megamoe-sac", "torchtitan-sac", "full-ac"],
)
def test_activation_checkpointing_saves_or_recomputes_megamoe(policy, megamoe_runs, calls):
    _, mega = moe_pair("deepseek_v3_debugmodel", ROUTED)
    x, dy = _inputs(mega)
    y, dx = _run(mega, x, dy)
    g = grads(mega)
    mega.zero_grad(set_to_none=True)
    del calls[:]
    wrapped = policy.Config().build()._wrap_block(mega)
    yc, dxc = _run(wrapped, x, dy)
    assert len(calls) == megamoe_runs  # 2: the backward ran megamoe's forward again
    assert torch.equal(yc, y) and torch.equal(dxc, dx)  # megamoe is deterministic
    gc = {n.replace("_checkpoint_wrapped_module.", ""): t for n, t in grads(wrapped).items()}
    for n in g:
        assert torch.equal(gc[n], g[n]), n


# -- expert parallelism over gloo, through torchtitan's mesh and parallelize ---------------------

EP_NAME = "deepseek_v3_debugmodel"  # 8 experts: 4 per rank


def _ep_worker(rank: int, world_size: int) -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import utils as dist_utils

    # torchtitan builds its mesh on "cuda" when no accelerator is found; gloo ranks need "cpu"
    parallel_dims_module.device_type = "cpu"
    ParallelDims = parallel_dims_module.ParallelDims
    for spmd_backend in ("spmd_types", "partial_dtensor"):
        dist_utils.set_spmd_backend(spmd_backend)
        pd = ParallelDims(
            dp_replicate=1,
            dp_shard=world_size,
            cp=1,
            tp=1,
            pp=1,
            ep=world_size,
            world_size=world_size,
            spmd_backend=spmd_backend,
        )
        for override in OVERRIDES:
            _ep_case(rank, world_size, pd, spmd_backend, override)


def _ep_case(rank, world_size, pd, spmd_backend, override) -> None:
    what = f"{spmd_backend} {override.rsplit('.', 1)[1]}"
    native, full = moe_pair(EP_NAME, override)  # one process, every expert
    cfg = trainer_config(EP_NAME, ep=world_size, spmd_backend=spmd_backend)
    apply(cfg, [(override, FP32)])
    (i, moe_cfg), *_ = moe_layers(cfg.model_spec.model)
    ep = moe_cfg.build()
    ep.load_state_dict(full.state_dict(), strict=True)
    # unsharded expert weights with a 2-rank group: refused by name
    with pytest.raises(ValueError, match="inner_experts holds 8 experts on each of 2"):
        ep.routed_experts.set_ep_group(dist.group.WORLD)
    ep.parallelize(pd)
    assert dist.get_world_size(ep.routed_experts.ep_group) == world_size, what
    e_local = 8 // world_size
    w1 = local(ep.routed_experts.inner_experts.w1_EFD)
    assert w1.shape[0] == e_local, what
    experts = slice(rank * e_local, (rank + 1) * e_local)
    assert torch.equal(w1, full.routed_experts.inner_experts.w1_EFD.detach()[experts]), what

    x, dy = _inputs(full, batch=2 * world_size, seq=8, seed=11)
    mine = slice(2 * rank, 2 * rank + 2)
    y1, dx1 = _run(full, x, dy)
    y0, _ = _run(native, x, dy)
    y, dx = _run(ep, x[mine].contiguous(), dy[mine].contiguous())
    assert rel_err(y, y0[mine]) < TOL, what
    # the same rows in the same order at every world size: bitwise
    assert torch.equal(y, y1[mine]), what
    assert torch.equal(dx, dx1[mine]), what
    g1, g = grads(full), {n: local(t) for n, t in grads(ep).items()}
    for n in g1:
        if "routed_experts.inner_experts" in n:
            assert torch.equal(g[n], g1[n][experts]), (what, n)
        else:  # replicated weights: each rank holds the gradient of its own tokens
            total = g[n].clone()
            dist.all_reduce(total)
            assert rel_err(total, g1[n]) < TOL, (what, n)


def test_expert_parallel_two_gloo_ranks_equal_one_process():
    run_gloo(2, _ep_worker)


def _fsdp_worker(rank: int, world_size: int) -> None:
    """FSDP2 (``fully_shard``, as torchtitan's ``apply_fsdp`` wraps a block: the experts, then
    the MoE module) over two gloo ranks, EP = 1: every weight sharded along dim 0, unsharded for
    the forward, gradients reduce-scattered (averaged) after megamoe's backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for override in OVERRIDES:
        what = override.rsplit(".", 1)[1]
        _, full = moe_pair(EP_NAME, override)  # one process, every token
        _, sharded = moe_pair(EP_NAME, override)
        fully_shard(sharded.routed_experts.inner_experts, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        assert gathered_per_call(sharded.routed_experts.inner_experts)  # (fp8: not cached)
        x, dy = _inputs(full, batch=2 * world_size, seq=8, seed=13)
        mine = slice(2 * rank, 2 * rank + 2)
        y1, dx1 = _run(full, x, dy)
        y, dx = _run(sharded, x[mine].contiguous(), dy[mine].contiguous())
        # (fewer rows per expert than one process: the CPU matmuls may sum in another order)
        assert rel_err(y, y1[mine]) < TOL, what
        assert rel_err(dx, dx1[mine]) < TOL, what
        g1 = grads(full)
        for n, p in sharded.named_parameters():
            mean = p.grad.full_tensor()  # FSDP averages the ranks' gradients
            assert rel_err(mean * world_size, g1[n]) < TOL, (what, n)


def test_fsdp2_over_two_gloo_ranks_equals_one_process():
    run_gloo(2, _fsdp_worker)


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"backend": "cuda"}, ValueError, r"backend must be one of \['auto', 'triton'"),
        ({"compute_dtype": "float16"}, ValueError, "compute_dtype must be one of"),
        (
            {"compute_dtype": "float32", "backend": "fused"},
            ValueError,
            "compute_dtype='float32' runs on backend 'reference' only",
        ),
        ({"check_values": "yes"}, TypeError, "check_values must be a bool, got 'yes'"),
        ({"rings": 4}, ValueError, r"unknown megamoe option\(s\) \['rings'\]"),
        ({"top_k": 2}, ValueError, r"unknown megamoe option\(s\) \['top_k'\]"),
        ({"ring_rows": 1536}, ValueError, r"ring_rows must be a multiple of minibatch_rows"),
        ({"capacity_factor": 0.5}, ValueError, "capacity_factor must be a number >= 1.0"),
        ({"precision": "fp4"}, ValueError, r"precision must be one of \['bf16', 'fp8'\]"),
    ],
)
def test_bad_options_are_refused_when_the_override_is_applied(options, error, match):
    cfg = trainer_config("deepseek_v3_debugmodel")
    with pytest.raises(error, match=match):
        apply(cfg, [(ROUTED, options)])


def test_overrides_refuse_what_they_cannot_run():
    cfg = trainer_config("deepseek_v3_debugmodel")
    apply(cfg, [ROUTED])
    with pytest.raises(ValueError, match="already a MegaMoERoutedExperts.Config"):
        apply(cfg, [ROUTED])
    with pytest.raises(ValueError, match="ancestor"):  # torchtitan's own conflict check
        apply(trainer_config("deepseek_v3_debugmodel"), [ROUTED, WHOLE_MOE])

    from torchtitan.models.gpt_oss.config_registry import gpt_oss_debugmodel

    gpt_oss = gpt_oss_debugmodel()
    with pytest.raises(TypeError, match="inner_experts of type GptOssGroupedExperts.Config"):
        apply(gpt_oss, [ROUTED])
    with pytest.raises(TypeError, match="got the subclass GptOssMoE.Config"):
        apply(gpt_oss, [WHOLE_MOE])
    fused = trainer_config("deepseek_v3_debugmodel")
    apply(fused, ["torchtitan.overrides.fused_swiglu.fused_grouped_experts"])
    with pytest.raises(TypeError, match="inner_experts of type FusedGroupedExperts.Config"):
        apply(fused, [ROUTED])
    full_ac = trainer_config("deepseek_v3_debugmodel")
    full_ac.activation_checkpoint = FullAC.Config()
    assert apply(full_ac, [SAC]) == []  # nothing to replace (torchtitan logs a warning)


def test_module_refuses_bad_calls_and_layouts():
    _, mega = moe_pair("deepseek_v3_debugmodel", WHOLE_MOE)
    tp = types.SimpleNamespace(tp=2, spmd_backend="spmd_types")
    with pytest.raises(NotImplementedError, match="tensor_parallel_degree=2"):
        mega.parallelize(tp)
    full = types.SimpleNamespace(tp=1, spmd_backend="full_dtensor")
    with pytest.raises(NotImplementedError, match="got 'full_dtensor'"):
        mega.parallelize(full)
    experts = mega.routed_experts
    x = torch.randn(1, 4, 256)
    scores = torch.full((1, 4, 3), 1 / 3)
    ids = torch.tensor([[[0, 1, 2]] * 4])
    counts = torch.zeros(8)
    with pytest.raises(ValueError, match=r"x_BLD must be a 3-D \(B, L, D\) tensor, got \[4, 256\]"):
        experts(x[0], scores, ids, counts)
    with pytest.raises(ValueError, match=r"topk_expert_ids_BLK must have shape \[1, 4, 3\]"):
        experts(x, scores, ids[..., :2], counts)
    # megamoe's own value checks run in eager mode (check_values=True)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 8\), got 8"):
        experts(x, scores, ids + 6, counts)
    with pytest.raises(ValueError, match="topk_weights must be finite"):
        experts(x, scores * float("nan"), ids, counts)


def test_docs_example_runs_as_written(capsys):
    """docs/torchtitan.md's example, executed."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md"
    text = doc.read_text().split("## Example", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, str(doc), "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "MegaMoERoutedExperts" in out and "relative difference" in out
