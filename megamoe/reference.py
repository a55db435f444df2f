"""The pure-PyTorch MoE layer: the oracle every kernel is tested against, and a fallback.

Written to be obviously right rather than fast: one loop over local experts, one loop over k.
Autograd provides the backward, including the router-weight gradient. Expert parallelism moves
token rows with ``all_to_all_single`` (host-synchronized split sizes), which works with NCCL and
with gloo on the CPU.

Numerics (the contract the kernels match within bf16 tolerances):
  g = x W_gate^T, u = x W_up^T   (matmul in the compute dtype, fp32 accumulation)
  h = silu(g) * u                 (fp32, rounded to the compute dtype)
  z = h W_down^T                  (compute dtype)
  y = sum_k w[t,k] * z[t,k]       (fp32, k = 0..K-1 in order) + shared(x)   -> x.dtype

``precision="fp8"`` (``MoEConfig.precision``; docs/fp8.md) is the block-scaled recipe in torch
ops: each of the three GEMMs of an expert quantizes its operands as the kernels do (1x128
activations and output gradients, 128x1 along the rows for the weight gradient, 128x128
weights; power-of-two scales), dequantizes them exactly and multiplies in fp32, with the
kernels' roundings (h from the fp32 gate/up products, the SwiGLU backward from the fp32 d_h).
x is quantized 1x128 once, and its 128x1 operand of the gate/up weight gradients is re-blocked
from that quantization (the kernels quantize each token on its rank before the dispatch; a
1x128 block lies inside one token's row, so quantizing the exchanged rows gives the same
values). The output gradient dy of the routed experts is quantized 1x128 once per token, as the
layer's dy pull moves it: their dz = w * dy and the router-weight gradient <dy, z> read those
values (the shared expert reads the unquantized dy, as the layer's). A reference of the recipe,
not of the kernels' bits (the fp32 sums run in another order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import MoEConfig
from .errors import RoutingError
from .types import ExpertWeights
from .validation import group_size_rank

__all__ = [
    "swiglu_mlp",
    "local_experts_forward",
    "weighted_combine",
    "RoutingPlan",
    "plan_routing",
    "check_ids",
    "all_to_all_rows",
    "moe_reference",
]


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax / 448)), its exponent at least -126; 1 for a block of zeros."""
    mant, exp = torch.frexp(amax.double() / 448.0)
    exp = torch.where(mant == 0.5, exp - 1, exp).clamp(min=-126)
    scale = torch.where(amax == 0, 1.0, torch.ldexp(torch.ones_like(mant), exp))
    return torch.where(amax.isinf(), float("inf"), scale).float()


def fp8_blocks(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [M, K]`` quantized to E4M3 in blocks of ``rows`` x 128 (``rows`` 1: 1x128 along K;
    128: 128x128) with power-of-two scales, dequantized (exactly) in fp32."""
    m, k = x.shape
    mb, kb = -(-m // rows), -(-k // 128)
    xp = F.pad(x.float(), (0, kb * 128 - k, 0, mb * rows - m)).view(mb, rows, kb, 128)
    amax = torch.nan_to_num(xp.abs(), nan=0.0).amax(dim=(1, 3), keepdim=True)
    scale = _pow2_scale(amax)
    q = (xp / scale).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(mb * rows, kb * 128)[:m, :k]


def _fp8_cols(x: torch.Tensor) -> torch.Tensor:
    """``x [N, M]`` in 128x1 blocks along the rows (a weight gradient's operand)."""
    return fp8_blocks(x.t(), 1).t()


class _Fp8Grad(torch.autograd.Function):
    """The identity, whose backward quantizes the gradient ``[T, H]`` 1x128 per token: the
    routed experts' dy in the fp8 recipe (the layer quantizes dy once, before its pull)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return fp8_blocks(grad, 1).to(grad.dtype)


class _Fp8Expert(torch.autograd.Function):
    """One SwiGLU expert in the fp8 recipe, forward and backward as the kernels compute it:
    h from the fp32 gate/up products, the SwiGLU backward from the fp32 d_h and the saved g, u
    in the compute dtype, d_x of the gate and up parts in one fp32 sum, the gate/up weight
    gradients' x re-blocked 128x1 from its 1x128 quantization (exact fp32 values)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        dtype = x.dtype
        wg, wu, wd = (fp8_blocks(w, 128) for w in (w_gate, w_up, w_down))
        xq = fp8_blocks(x, 1)
        g, u = xq @ wg.t(), xq @ wu.t()
        h = (F.silu(g) * u).to(dtype)
        ctx.save_for_backward(x, w_gate, w_up, w_down, g.to(dtype), u.to(dtype), h)
        return (fp8_blocks(h, 1) @ wd.t()).to(dtype)

    @staticmethod
    def backward(ctx, dz):
        x, w_gate, w_up, w_down, g, u, h = ctx.saved_tensors
        dtype = x.dtype
        dz = dz.to(dtype)
        dh = fp8_blocks(dz, 1) @ fp8_blocks(w_down, 128)
        g, u = g.float(), u.float()
        sig = torch.sigmoid(g)
        dg, du = (dh * u * sig * (1 + g * (1 - sig))).to(dtype), (dh * g * sig).to(dtype)
        dx = fp8_blocks(dg, 1) @ fp8_blocks(w_gate, 128) + fp8_blocks(du, 1) @ fp8_blocks(w_up, 128)
        xc = _fp8_cols(fp8_blocks(x, 1))
        d_gate = (_fp8_cols(dg).t() @ xc).to(w_gate.dtype)
        d_up = (_fp8_cols(du).t() @ xc).to(w_up.dtype)
        d_down = (_fp8_cols(dz).t() @ _fp8_cols(h)).to(w_down.dtype)
        return dx.to(dtype), d_gate, d_up, d_down


def swiglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    precision: str = "bf16",
) -> torch.Tensor:
    """One SwiGLU expert on rows ``x [N, H]``; weights [I, H], [I, H], [H, I]."""
    if precision == "fp8":
        return _Fp8Expert.apply(x, w_gate, w_up, w_down)
    g = x @ w_gate.t()
    u = x @ w_up.t()
    act = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for the fp64 oracle
    h = (F.silu(g.to(act)) * u.to(act)).to(x.dtype)
    return h @ w_down.t()


def local_experts_forward(
    rows: torch.Tensor,
    local_ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    precision: str = "bf16",
) -> torch.Tensor:
    """Apply local expert ``local_ids[n]`` to ``rows[n]``, one expert at a time."""
    if rows.shape[0] == 0:
        # Keep the (empty) output in the autograd graph: the backward's all-to-all must still
        # run on a rank that received nothing, or its peers would wait for it.
        return rows.clone()
    # Group rows by expert (stable: each expert keeps its rows in arrival order), run each
    # expert on its block, and put the results back with one permutation.
    perm = torch.sort(local_ids, stable=True).indices
    counts = torch.bincount(local_ids, minlength=w_gate.shape[0]).tolist()
    blocks = rows.index_select(0, perm).split(counts)
    # unbind, not w[e]: the backward of one unbind stacks the per-expert gradients once, where
    # each w[e] would materialize (and add) a gradient the size of all experts' weights.
    gate, up, down = w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)
    outs = [
        swiglu_mlp(b, gate[e], up[e], down[e], precision) for e, b in enumerate(blocks) if len(b)
    ]
    grouped = torch.cat(outs)
    return grouped.new_empty(grouped.shape).index_copy(0, perm, grouped)


def weighted_combine(
    z: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: torch.Tensor | None,
    precision: str = "bf16",
) -> torch.Tensor:
    """``sum_k w[t,k] * z[t,k]`` in fp32, k in order, then the shared expert; z is [T, K, H].
    ``precision="fp8"``: the routed sum's gradient (dy) is quantized 1x128 per token."""
    acc = torch.zeros(z.shape[0], z.shape[2], dtype=torch.float32, device=z.device)
    if z.dtype == torch.float64:
        acc = acc.double()
    for k in range(z.shape[1]):
        acc = acc + topk_weights[:, k, None].to(acc.dtype) * z[:, k].to(acc.dtype)
    if precision == "fp8":
        acc = _Fp8Grad.apply(acc)
    if shared is not None:
        acc = acc + shared.to(acc.dtype)
    return acc


class _AllToAllRows(torch.autograd.Function):
    """all_to_all_single over dim 0 with autograd: the backward sends gradients back."""

    @staticmethod
    def forward(
        ctx,
        rows: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _exchange(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(
    rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    # Rows travel as raw bytes, so every dtype (bf16 on gloo included) is exchanged exactly.
    rows = rows.contiguous()
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    row_elems = math.prod(rows.shape[1:])
    as_bytes = lambda t: t.view(t.shape[0], row_elems).view(torch.uint8)  # noqa: E731
    dist.all_to_all_single(as_bytes(out), as_bytes(rows), out_splits, in_splits, group=group)
    return out


def all_to_all_rows(
    rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable exchange of row blocks: ``in_splits[r]`` rows go to rank r."""
    return _AllToAllRows.apply(rows, out_splits, in_splits, group)


@dataclass(frozen=True)
class RoutingPlan:
    """Where every (token, k) row of this rank goes, and what this rank receives.

    ``order`` sorts the flattened (t*K + k) rows by destination rank, stably, so each rank
    receives rows in (source rank, token, k) order: the row layout is a pure function of all
    ranks' topk_ids.
    """

    order: torch.Tensor  # [T*K] permutation of flattened rows, grouped by destination
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    recv_local_ids: torch.Tensor  # [sum(recv_counts)] local expert id of each received row


def check_ids(topk_ids: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None) -> None:
    """Raise :class:`~megamoe.errors.RoutingError` on every rank when some rank's ids are
    outside ``[0, num_experts)``, naming the first (a host read and, with a group, a collective:
    this is the reference)."""
    world_size, _ = group_size_rank(group)
    flat = topk_ids.reshape(-1)
    bad = ((flat < 0) | (flat >= num_experts)).nonzero()
    k = topk_ids.shape[1]
    # (found, token, k, value) of this rank's first bad id
    mine = torch.zeros(4, dtype=torch.int64, device=flat.device)
    if len(bad):
        i = int(bad[0])
        mine = torch.tensor([1, i // k, i % k, int(flat[i])], device=flat.device)
    every = [mine]
    if group is not None:
        every = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine, group=group)
    for rank, (found, token, j, value) in enumerate(t.tolist() for t in every):
        if found:
            where = f"token {token}, k {j}" + (f" of rank {rank}" if group is not None else "")
            raise RoutingError(f"topk_ids must be in [0, {num_experts}), got {value} ({where})")


def plan_routing(
    topk_ids: torch.Tensor, config: MoEConfig, group: dist.ProcessGroup | None
) -> RoutingPlan:
    """Where each row goes; the ids are checked first (:func:`check_ids`)."""
    world_size, rank = group_size_rank(group)
    check_ids(topk_ids, config.num_experts, group)
    e_local = config.local_experts(world_size)
    flat = topk_ids.reshape(-1).long()
    if group is None:
        order = torch.arange(flat.numel(), device=flat.device)
        n = flat.numel()
        return RoutingPlan(order, [n], [n], flat)
    dest = flat // e_local
    order = torch.sort(dest, stable=True).indices
    send = torch.bincount(dest, minlength=world_size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    recv_ids = _exchange(flat[order], recv_counts, send_counts, group)
    return RoutingPlan(order, send_counts, recv_counts, recv_ids - rank * e_local)


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    plan: RoutingPlan | None = None,
    precision: str = "bf16",
) -> torch.Tensor:
    """The MoE layer in plain PyTorch; differentiable. Returns ``y`` in x.dtype.

    ``compute_dtype=torch.float64`` runs the whole layer in float64 (the accuracy oracle) and
    returns float64. ``precision="fp8"``: the expert GEMMs in the fp8 recipe (the module
    docstring); the default ignores ``config.precision``, so the oracle stays unquantized.
    """
    out_dtype = x.dtype
    if compute_dtype is not None:
        x = x.to(compute_dtype)
        weights = ExpertWeights(*(w.to(compute_dtype) if w is not None else None for w in weights))
        out_dtype = compute_dtype
    t, k, h = x.shape[0], config.top_k, x.shape[1]
    if plan is None:
        plan = plan_routing(topk_ids, config, group)
    rows = x.unsqueeze(1).expand(t, k, h).reshape(t * k, h).index_select(0, plan.order)
    if group is not None:
        rows = all_to_all_rows(rows, plan.recv_counts, plan.send_counts, group)
    z = local_experts_forward(
        rows, plan.recv_local_ids, weights.w_gate, weights.w_up, weights.w_down, precision
    )
    if group is not None:
        z = all_to_all_rows(z, plan.send_counts, plan.recv_counts, group)
    z = z.new_zeros(z.shape).index_copy(0, plan.order, z).view(t, k, h)
    shared = None
    if weights.has_shared:
        shared = swiglu_mlp(x, weights.s_gate, weights.s_up, weights.s_down, precision)
    return weighted_combine(z, topk_weights, shared, precision).to(out_dtype)
