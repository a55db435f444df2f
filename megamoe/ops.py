"""The layer as two custom ops with fake implementations and a registered autograd formula.

``megamoe::moe_forward`` returns ``y`` and the backend's saved state as a flat list of tensors
(``save`` of the backend: the schedule, the routed and shared activations, ...);
``megamoe::moe_backward`` takes them back and returns every gradient. Both are opaque to
``torch.compile``: Dynamo sees one call and traces no host code of the layer, AOTAutograd puts
the backward op in the backward graph, and their fake implementations give every output's shape
and dtype from the inputs and the config alone (``saved_layout`` of the backend). So a model
with megamoe layers compiles with ``fullgraph=True``, and a compiled training step can be
captured in a CUDA graph (the Triton backends read nothing from the device on the host).
Eager calls run the same two ops under a plain ``autograd.Function`` (:class:`_EagerMoE`:
the same saved tensors and gradients at a fraction of the registered autograd's host time),
calling their bodies directly unless a dispatch mode or the profiler watches.

The config and the process group travel as strings (``MoEConfig.key``, the group's name). Not
supported: second-order gradients (the backward raises), ``torch.func`` transforms (``grad``,
``vjp``, ``jvp``, ``vmap``, ...; :func:`moe` raises before the op).
"""

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from . import functional
from .backends import get_backend, resolve_backend
from .config import MoEConfig
from .types import ExpertWeights, MoEGrads
from .validation import group_size_rank, require_expert_weights, validate_inputs

__all__ = ["moe", "moe_forward", "moe_backward", "group_key"]


def group_key(group: dist.ProcessGroup | None) -> str:
    """How a process group travels through the ops: its name ("" for one process)."""
    return "" if group is None else group.group_name


@functools.lru_cache(maxsize=64)
def _group(key: str) -> dist.ProcessGroup | None:
    if not key:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(key)


def _weights(w_gate, w_up, w_down, s_gate, s_up, s_down) -> ExpertWeights:
    """The op's weight inputs as the backends take them: ``w_up`` None means ``w_gate`` is the
    stacked ``[E, 2I, H]`` gate/up weight (read through views, no copy)."""
    return ExpertWeights(w_gate, w_up, w_down, s_gate, s_up, s_down).split_gate_up()


def _unpack(config: str, group: str) -> tuple[MoEConfig, dist.ProcessGroup | None, int]:
    grp = _group(group)
    return MoEConfig.from_key(config), grp, group_size_rank(grp)[0]


def _forward_impl(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor | None,
    w_down: Tensor,
    s_gate: Tensor | None,
    s_up: Tensor | None,
    s_down: Tensor | None,
    config: str,
    group: str,
    backend: str,
    check_values: bool,
) -> tuple[Tensor, list[Tensor]]:
    """``y`` and the saved state of ``functional.forward`` (the schedule is built inside)."""
    cfg, grp, _ = _unpack(config, group)
    weights = _weights(w_gate, w_up, w_down, s_gate, s_up, s_down)
    y, ctx = functional.forward(
        x,
        topk_ids,
        topk_weights,
        weights,
        cfg,
        group=grp,
        backend=backend,
        check_values=check_values,
    )
    return y, get_backend(ctx.backend).save(ctx.state)


moe_forward = torch.library.custom_op("megamoe::moe_forward", mutates_args=())(_forward_impl)


@moe_forward.register_fake
def _forward_fake(
    x,
    topk_ids,
    topk_weights,
    w_gate,
    w_up,
    w_down,
    s_gate,
    s_up,
    s_down,
    config,
    group,
    backend,
    check_values,
):
    cfg, grp, world = _unpack(config, group)
    weights = _weights(w_gate, w_up, w_down, s_gate, s_up, s_down)
    validate_inputs(x, topk_ids, topk_weights, weights, cfg, grp, check_values=False)
    name = resolve_backend(backend, x.device, world, cfg, x.dtype, x.shape[0])
    layout = get_backend(name).saved_layout(cfg, x.shape[0], world, x.dtype)
    return x.new_empty(x.shape), [x.new_empty(shape, dtype=dt) for _, shape, dt in layout]


def _backward_impl(
    grad_y: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor | None,
    w_down: Tensor,
    s_gate: Tensor | None,
    s_up: Tensor | None,
    s_down: Tensor | None,
    saved: list[Tensor],
    config: str,
    group: str,
    backend: str,
) -> list[Tensor]:
    """d_x, d topk_weights and the weight gradients (the shared expert's last, when present)."""
    cfg, grp, world = _unpack(config, group)
    weights = _weights(w_gate, w_up, w_down, s_gate, s_up, s_down)
    name = resolve_backend(backend, x.device, world, cfg, x.dtype, x.shape[0])
    impl = get_backend(name)
    state = impl.restore(saved, x, topk_ids, topk_weights, weights, cfg, grp)
    ctx = functional.MoEContext(name, state, tuple(x.shape), x.dtype, x.device)
    grads = functional.backward(ctx, grad_y)
    if w_up is None:  # one gradient for the stacked gate/up weight
        grads = MoEGrads(grads.x, grads.topk_weights, grads.w_gate_up, None, *grads[4:])
    return [g for g in grads if g is not None]


moe_backward = torch.library.custom_op("megamoe::moe_backward", mutates_args=())(_backward_impl)


@moe_backward.register_fake
def _backward_fake(
    grad_y,
    x,
    topk_ids,
    topk_weights,
    w_gate,
    w_up,
    w_down,
    s_gate,
    s_up,
    s_down,
    saved,
    config,
    group,
    backend,
):
    inputs = (x, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down)
    return [t.new_empty(t.shape) for t in inputs if t is not None]


def _save(ctx, inputs, saved) -> None:
    x, topk_ids, topk_weights, *weights, config, group, backend, _ = inputs
    ctx.save_for_backward(x, topk_ids, topk_weights, *weights, *saved)
    ctx.static = (config, group, backend)


def _setup_context(ctx, inputs, output) -> None:
    _, saved = output
    _save(ctx, inputs, saved)
    ctx.mark_non_differentiable(*saved)
    # The saved state gets no gradient: without this autograd would hand the backward a zeroed
    # tensor the size of every saved activation (a memset of all of them and a host allocation
    # each, every step).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, grad_saved, dispatch: bool = True):
    """The registered formula (``dispatch``: through the backward op, always, as AOTAutograd
    traces it) and the eager one (:class:`_EagerMoE`)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "megamoe's backward is not differentiable: second-order gradients "
            "(backward with create_graph=True, double backward) are not supported"
        )
    x, topk_ids, topk_weights, *rest = ctx.saved_tensors
    weights, saved = rest[:6], rest[6:]
    backward = torch.ops.megamoe.moe_backward if dispatch else _backward_impl
    grads = backward(grad_y, x, topk_ids, topk_weights, *weights, saved, *ctx.static)
    dx, d_topk, *d_weights = grads
    d_weights = iter(d_weights)  # one per weight input that is not None, in order
    d_w = [None if w is None else next(d_weights) for w in weights]
    return dx, None, d_topk, *d_w, None, None, None, None


torch.library.register_autograd("megamoe::moe_forward", _backward, setup_context=_setup_context)


_PLAIN = (Tensor, torch.nn.Parameter)


def _subclassed(args: tuple) -> bool:
    """Whether a tensor of ``args`` is a subclass with dispatch of its own (not a Parameter)."""
    return any(isinstance(a, Tensor) and type(a) not in _PLAIN for a in args)


def _dispatch_ops() -> bool:
    """Whether an eager call must go through the dispatcher to reach the ops: while a
    ``TorchDispatchMode`` is active (selective activation checkpointing's policy, fake tensors,
    op recorders see ``megamoe::moe_forward``) or the autograd profiler runs (its trace names
    the two ops); so must a call with tensor subclasses (:func:`_subclassed`: their own
    dispatch decides). Otherwise the eager path calls the ops' Python bodies directly: the same
    code, without the dispatcher's boxing of two dozen tensors and the custom op's checks,
    about 0.1 ms of host time a call."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._autograd._profiler_enabled()


class _EagerMoE(torch.autograd.Function):
    """The eager form of the same two ops: a plain ``autograd.Function`` that calls
    ``moe_forward`` below autograd and ``moe_backward`` in its backward.

    Why not the op's registered autograd in eager mode too: its generic wrapper (flattening the
    saved tensor list through pytrees, re-filling the schema's defaults) costs about a
    millisecond of host time per training step, as much as a small layer's GPU time. The ops
    are dispatched whenever something may watch them (:func:`_dispatch_ops`), so
    ``TorchDispatchMode``-based tools (selective activation checkpointing's save list:
    ``integrations.torchtitan.ac``) see ``megamoe::moe_forward`` as before, and the saved
    tensors, the double-backward refusal and the gradients are the registered formula's."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.subclassed = _subclassed(inputs)
        dispatch = ctx.subclassed or _dispatch_ops()
        y, saved = (torch.ops.megamoe.moe_forward if dispatch else _forward_impl)(*inputs)
        _save(ctx, inputs, saved)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        dispatch = ctx.subclassed or _subclassed((grad_y,)) or _dispatch_ops()
        return _backward(ctx, grad_y, None, dispatch=dispatch)


def moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str = "reference",
    check_values: bool = True,
    group_name: str | None = None,
) -> Tensor:
    """Autograd-enabled MoE through the custom ops (``functional.moe``). ``group_name``: the
    group's :func:`group_key` when the caller has it (a module computes it once)."""
    if torch.compiler.is_compiling():
        check_values = False  # nothing in a traced step reads the device: the kernels check
    elif torch._C._functorch.peek_interpreter_stack() is not None:
        raise RuntimeError(
            "megamoe does not support torch.func transforms (grad, vjp, jvp, "
            "vmap, jacrev, ...): its ops' autograd formula is not one functorch "
            "can transform. Use torch.autograd (backward() or "
            "torch.autograd.grad) instead."
        )
    require_expert_weights(weights)
    inputs = (
        x,
        topk_ids,
        topk_weights,
        *weights,
        config.key,
        group_key(group) if group_name is None else group_name,
        backend,
        check_values,
    )
    if torch.compiler.is_compiling():  # the op's registered autograd: AOTAutograd traces it
        y, _ = torch.ops.megamoe.moe_forward(*inputs)
        return y
    return _EagerMoE.apply(*inputs)
