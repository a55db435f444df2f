"""The schedule and the saved state of the Triton backends ("triton" and "fused" share them),
and that state as a flat list of tensors (the custom ops of ``megamoe.ops`` carry it from the
forward to the backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..ep.workspace import Workspace, get_workspace
from ..kernels.fp8 import packed_width
from ..kernels.schedule import RowSchedule, max_rows
from ..types import ExpertWeights, RoutedActivations, SharedActivations
from .fp8_weights import StepWeights, from_transposed, transposed_layout, transposed_tensors

__all__ = [
    "EpRouting",
    "TritonSchedule",
    "TritonContext",
    "EmptyContext",
    "workspace_of",
    "schedule_rows",
    "saved_layout",
    "save",
    "restore",
]


@dataclass(frozen=True)
class EpRouting:
    """What an expert-parallel schedule adds: the workspace and every rank's routing."""

    workspace: Workspace
    all_ids: torch.Tensor  # [W*T, K] int32, the schedule's input (global slot order)
    capacity: int  # real routed rows one rank may hold


@dataclass(frozen=True)
class TritonSchedule:
    """Row layout of the routed experts (device tensors) plus the config it was built for;
    ``ep`` is None for one process.

    ``invalid`` (int32 [1], written by the schedule's device checks, ``kernels.checks``): 1 when
    the step's ids were out of range or overflowed the capacity. The schedule is then empty and
    the combines write NaN instead of reading missing slots; 0 otherwise (the same bits as
    without the check).
    """

    routed: RowSchedule
    config: MoEConfig
    invalid: torch.Tensor
    ep: EpRouting | None = None


@dataclass
class TritonContext:
    """What the backward reads. ``routed`` is None when a bounded ring dropped the routed rows
    (backend "fused"; its backward replays them). ``fp8``: in fp8 the weights' fp8 copies the
    forward read, whose transposed copies the data gradients read (``fp8_weights``)."""

    schedule: TritonSchedule
    x: torch.Tensor
    slot_weights: torch.Tensor  # router weights by global slot: [T*K] (W=1) or [W*T*K] (W>1)
    weights: ExpertWeights
    routed: RoutedActivations | None
    shared: SharedActivations | None
    fp8: StepWeights | None = None


@dataclass
class EmptyContext:
    """A step of no tokens (T = 0 on every rank): nothing to compute, zero weight gradients."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    weights: ExpertWeights


def workspace_of(target) -> Workspace | None:
    """The workspace of a schedule, a context or a workspace; None for one process."""
    if isinstance(target, TritonContext):
        target = target.schedule
    if isinstance(target, TritonSchedule):
        return target.ep.workspace if target.ep is not None else None
    if isinstance(target, EmptyContext):
        return None
    return target


# --------------------------------------------------------------------------------------------
# The context as a list of tensors


def schedule_rows(config: MoEConfig, tokens: int, world_size: int) -> tuple[int, int]:
    """(rows of the schedule's tables, rows of the routed buffers) of a step of ``tokens`` per
    rank: the worst case, and below it the capacity's rows at W > 1 (``kernels.checks``)."""
    entries = world_size * tokens * config.top_k
    e_local = config.local_experts(world_size)
    full = max_rows(entries, e_local, config.block_rows)
    if world_size == 1:
        return full, full
    capacity = config.capacity_rows(tokens, world_size)
    if capacity >= entries:
        return full, full
    return full, min(full, max_rows(capacity, e_local, config.block_rows))


_SCHEDULE = ("dest_row", "row_src", "row_start", "counts", "block_expert", "num_blocks")


def saved_layout(
    config: MoEConfig, tokens: int, world_size: int, dtype: torch.dtype, keeps_routed: bool
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor :func:`save` returns for such a step, in order:
    the schedule, its invalid word, every rank's ids and router weights (W > 1), the routed
    activations (``keeps_routed``), the shared expert's and in fp8 with ``fp8_weight_cache``
    the weights' transposed fp8 copies (``fp8_weights.transposed_layout``)."""
    if tokens == 0:
        return []
    i32, k = torch.int32, config.top_k
    e_local = config.local_experts(world_size)
    entries = world_size * tokens * k
    table_rows, rows = schedule_rows(config, tokens, world_size)
    out = [
        ("dest_row", (entries,), i32),
        ("row_src", (table_rows,), i32),
        ("row_start", (e_local + 1,), i32),
        ("counts", (e_local,), i32),
        ("block_expert", (table_rows // config.block_rows,), i32),
        ("num_blocks", (1,), i32),
        ("invalid", (1,), i32),
    ]
    if world_size > 1:
        out += [
            ("all_ids", (world_size * tokens, k), i32),
            ("slot_weights", (entries,), torch.float32),
        ]
    h, i, i_s = config.hidden_size, config.intermediate_size, config.shared_intermediate_size
    fp8 = config.precision == "fp8"

    def h_layout(n: int, width: int) -> tuple[tuple[int, int], torch.dtype]:
        # SwiGLU's output: in fp8 h^T 128x1-quantized as packed rows (the weight gradient's)
        return ((width, packed_width(n + -n % 16)), torch.int16) if fp8 else ((n, width), dtype)

    if keeps_routed:
        # the routed input rows: in fp8 their packed 1x128 quantization, as dispatched
        xs = ((rows, packed_width(h)), torch.int16) if fp8 else ((rows, h), dtype)
        out += [
            ("xs", *xs),
            ("g", (rows, i), dtype),
            ("u", (rows, i), dtype),
            ("h", *h_layout(rows, i)),
            ("z", (rows, h), dtype),
        ]
    if i_s:
        out += [(f"shared_{n}", (tokens, i_s), dtype) for n in ("g", "u")]
        out.append(("shared_h", *h_layout(tokens, i_s)))
    if fp8 and config.fp8_weight_cache:  # (else the backward quantizes the weights again)
        out += transposed_layout(e_local, h, i, i_s)
    return out


def save(ctx: TritonContext | EmptyContext) -> list[torch.Tensor]:
    """The context's tensors in :func:`saved_layout`'s order (inputs not included)."""
    if isinstance(ctx, EmptyContext):
        return []
    sched = ctx.schedule
    out = [getattr(sched.routed, n) for n in _SCHEDULE] + [sched.invalid]
    if sched.ep is not None:
        out += [sched.ep.all_ids, ctx.slot_weights]
    out += list(ctx.routed or ()) + list(ctx.shared or ())
    if ctx.fp8 is not None:
        out += transposed_tensors(ctx.fp8)
    return out


def restore(
    saved: list[torch.Tensor],
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
    keeps_routed: bool,
) -> TritonContext | EmptyContext:
    """The context :func:`save` flattened, from its tensors and the step's inputs."""
    if x.shape[0] == 0:
        return EmptyContext(x, topk_weights, weights)
    world = 1 if group is None else dist.get_world_size(group)
    tokens, k = topk_weights.shape
    it = iter(saved)
    tables = {n: next(it) for n in _SCHEDULE}
    invalid = next(it)
    _, rows = schedule_rows(config, tokens, world)
    routed = RowSchedule(
        **tables,
        num_tokens=world * tokens,
        top_k=k,
        num_experts=config.local_experts(world),
        block_rows=config.block_rows,
        rows=rows,
        world_size=world,
    )
    ep, slot_weights = None, topk_weights.view(-1)
    if world > 1:
        all_ids, slot_weights = next(it), next(it)
        ws = get_workspace(group, tokens, config.hidden_size, k, x.dtype, x.device)
        ep = EpRouting(ws, all_ids, config.capacity_rows(tokens, world))
    acts = RoutedActivations(*(next(it) for _ in range(5))) if keeps_routed else None
    shared = SharedActivations(*(next(it) for _ in range(3))) if weights.has_shared else None
    rest = list(it)
    fp8 = from_transposed(rest) if rest else None
    return TritonContext(
        TritonSchedule(routed, config, invalid, ep), x, slot_weights, weights, acts, shared, fp8
    )
