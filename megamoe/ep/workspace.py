"""Symmetric-memory workspace of the expert-parallel layer: buffers every rank can reach.

One symmetric allocation per (group, device, T, H, K, dtype, backward) holds, at the same offsets on
every rank, the published tokens, one combine slot per (token, k), their backward counterparts, the
routing exchange, barrier signal pads, the barrier epochs and the watchdog's error record. Kernels
reach a peer's copy through int64 tables of peer base addresses (``Workspace.peers``), which they
load and cast with ``.to(tl.pointer_type(...))``.

The same structure can be built from plain per-"rank" tensors (:func:`emulated_workspaces`), so the
kernels run under the CPU interpreter with W ranks emulated in one process.

Layout of a rank's allocation (each region starts at a multiple of ``REGION_ALIGN`` bytes):

  x_buffer        [T, H]    dtype  this rank's tokens, read (pulled) by the experts' owners; in
                                   fp8 their packed 1x128 quantization instead, [T, P] int16
                                   rows at the region's start (P = fp8.packed_width(H) <= H)
  combine_buffer  [T*K, H]  dtype  slot t*K+k, written (pushed) by the rank owning expert id[t,k]
  dy_buffer       [T, H]    dtype  backward: this rank's output gradient, pulled like x_buffer
                                   (in fp8 its packed 1x128 quantization, as x_buffer's)
  dx_slots        [T*K, H]  dtype  backward: d_x of slot t*K+k, pushed like combine_buffer
  dw_slots        [T*K]     fp32   backward: d topk_weights of slot t*K+k, pushed
  routing_ids     [T, K]    int32  this rank's topk_ids, read by every rank
  routing_weights [T, K]    fp32   this rank's topk_weights (the backward pull scales by them)
  signals         [C, W]    int32  barrier pad: entry [c, src] is written only by rank src
  epochs          [C]       int32  barriers passed per channel (local; advanced by the kernels)
  errors          [ERROR_WORDS] int32  first stall recorded by a spin-wait (local; fatal, see
                                       megamoe.errors.StallError)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ERROR_WORDS, ErrorWord, StallError, describe_stall

__all__ = [
    "Workspace",
    "PeerTables",
    "get_workspace",
    "clear_workspace_cache",
    "emulated_workspaces",
    "local_workspace",
    "local_workspaces",
    "cached_workspaces",
    "check_errors",
    "publish",
    "publish_packed",
    "packed_buffer",
    "packed_x_buffer",
    "BARRIER_CHANNELS",
    "REGION_ALIGN",
    "workspace_bytes",
    "take_stall",
]

# Regions start on this many bytes: 16 B vector loads need 16, TMA descriptors 16, L2 lines 128.
REGION_ALIGN = 1024
# Independent barrier channels (a barrier on one channel never disturbs another).
BARRIER_CHANNELS = 8


@dataclass(frozen=True)
class PeerTables:
    """int64 [W] device tensors: base address of each rank's copy of one workspace region."""

    x: torch.Tensor
    combine: torch.Tensor
    dy: torch.Tensor
    dx: torch.Tensor
    dw: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    signals: torch.Tensor


@dataclass(eq=False)
class Workspace:
    """This rank's views of the symmetric regions, plus the peer address tables."""

    rank: int
    world_size: int
    num_tokens: int
    hidden: int
    top_k: int
    dtype: torch.dtype
    device: torch.device
    backward: bool
    storage: torch.Tensor  # the whole local allocation (uint8)
    x_buffer: torch.Tensor
    combine_buffer: torch.Tensor
    dy_buffer: torch.Tensor | None
    dx_slots: torch.Tensor | None
    dw_slots: torch.Tensor | None
    routing_ids: torch.Tensor
    routing_weights: torch.Tensor
    signals: torch.Tensor
    epochs: torch.Tensor
    errors: torch.Tensor
    peers: PeerTables
    handle: Any = None  # the _SymmetricMemory handle (keeps the mapping alive); None if emulated
    group_name: str | None = None

    @property
    def slots(self) -> int:
        """Combine slots of one rank: T*K."""
        return self.num_tokens * self.top_k


# --------------------------------------------------------------------------------------------
# Layout


def _align(n: int) -> int:
    return (n + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN


def _regions(
    t: int, h: int, k: int, w: int, dtype: torch.dtype, backward: bool
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every region in allocation order; absent backward regions skipped."""
    regs = [("x_buffer", (t, h), dtype), ("combine_buffer", (t * k, h), dtype)]
    if backward:
        regs += [
            ("dy_buffer", (t, h), dtype),
            ("dx_slots", (t * k, h), dtype),
            ("dw_slots", (t * k,), torch.float32),
        ]
    regs += [
        ("routing_ids", (t, k), torch.int32),
        ("routing_weights", (t, k), torch.float32),
        ("signals", (BARRIER_CHANNELS, w), torch.int32),
        ("epochs", (BARRIER_CHANNELS,), torch.int32),
        ("errors", (ERROR_WORDS,), torch.int32),
    ]
    return regs


def _offsets(regs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[dict[str, int], int]:
    offsets, end = {}, 0
    for name, shape, dt in regs:
        offsets[name] = end
        numel = 1
        for s in shape:
            numel *= s
        end = _align(end + numel * dt.itemsize)
    return offsets, end


def _validate(t: int, h: int, k: int, dtype: torch.dtype) -> None:
    for name, value in (("num_tokens", t), ("hidden", h), ("top_k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if (h * dtype.itemsize) % 16:
        raise ValueError(
            f"hidden * itemsize must be a multiple of 16 bytes (vector copies), "
            f"got hidden={h} with {dtype}"
        )
    if t * k * h >= 2**31:
        raise ValueError(f"num_tokens*top_k*hidden must be < 2**31, got {t}*{k}*{h}")


_PEER_REGION = {
    "x": "x_buffer",
    "combine": "combine_buffer",
    "dy": "dy_buffer",
    "dx": "dx_slots",
    "dw": "dw_slots",
    "ids": "routing_ids",
    "weights": "routing_weights",
    "signals": "signals",
}


def _assemble(
    storage: torch.Tensor,
    bases: list[int],
    rank: int,
    t: int,
    h: int,
    k: int,
    dtype: torch.dtype,
    backward: bool,
    handle: Any,
    group_name: str | None,
) -> Workspace:
    """Carve ``storage`` into views and build the peer tables from each rank's base address."""
    w = len(bases)
    regs = _regions(t, h, k, w, dtype, backward)
    offsets, total = _offsets(regs)
    if storage.numel() < total:
        raise ValueError(f"storage holds {storage.numel()} bytes, the layout needs {total}")
    views: dict[str, torch.Tensor | None] = {"dy_buffer": None, "dx_slots": None, "dw_slots": None}
    for name, shape, dt in regs:
        nbytes = dt.itemsize
        for s in shape:
            nbytes *= s
        views[name] = storage[offsets[name] : offsets[name] + nbytes].view(dt).view(shape)
    # Absent (backward-only) regions get null addresses; the launchers refuse to use them.
    tables = torch.tensor(
        [
            [bases[r] + offsets[region] if region in offsets else 0 for r in range(w)]
            for region in _PEER_REGION.values()
        ],
        dtype=torch.int64,
        device=storage.device,
    )
    peers = PeerTables(**{f: tables[i] for i, f in enumerate(_PEER_REGION)})
    return Workspace(
        rank=rank,
        world_size=w,
        num_tokens=t,
        hidden=h,
        top_k=k,
        dtype=dtype,
        device=storage.device,
        backward=backward,
        storage=storage,
        peers=peers,
        handle=handle,
        group_name=group_name,
        **views,
    )


def workspace_bytes(
    t: int, h: int, k: int, world_size: int, dtype: torch.dtype, backward: bool = True
) -> int:
    """Bytes of one rank's allocation."""
    return _offsets(_regions(t, h, k, world_size, dtype, backward))[1]


# --------------------------------------------------------------------------------------------
# Construction


def emulated_workspaces(
    world_size: int,
    num_tokens: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    backward: bool = True,
) -> list[Workspace]:
    """W workspaces over plain tensors of one process, cross-linked like a symmetric allocation.

    For the CPU interpreter (and single-GPU tests): kernels launched with workspace r act as rank r
    and reach the other "ranks" through the same peer tables as on real hardware.
    """
    _validate(num_tokens, hidden, top_k, dtype)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    nbytes = workspace_bytes(num_tokens, hidden, top_k, world_size, dtype, backward)
    storages = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
    bases = [s.data_ptr() for s in storages]
    return [
        _assemble(s, bases, r, num_tokens, hidden, top_k, dtype, backward, None, None)
        for r, s in enumerate(storages)
    ]


_CACHE: dict[tuple, Workspace] = {}
# One-rank workspaces of plain device memory, per (device, T, H, K, dtype): see local_workspace.
_LOCAL: dict[tuple, Workspace] = {}


def local_workspace(
    num_tokens: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
) -> Workspace:
    """A cached one-rank workspace of plain device memory (no backward regions), so that a W = 1
    forward runs the expert-parallel kernels unchanged: it "pulls" from its own ``x_buffer``
    and "pushes" into its own combine slots."""
    key = (device, num_tokens, hidden, top_k, dtype)
    ws = _LOCAL.get(key)
    if ws is None:
        ws = emulated_workspaces(1, num_tokens, hidden, top_k, dtype, device, backward=False)[0]
        _LOCAL[key] = ws
    return ws


def local_workspaces() -> list[Workspace]:
    """The cached one-rank workspaces (:func:`local_workspace`)."""
    return list(_LOCAL.values())


def _group_name(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, str]:
    if not dist.is_initialized():
        raise RuntimeError("get_workspace needs an initialized torch.distributed process group")
    group = group if group is not None else dist.group.WORLD
    return group, group.group_name


def get_workspace(
    group: dist.ProcessGroup | None,
    num_tokens: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
    backward: bool = True,
) -> Workspace:
    """The cached symmetric workspace for these shapes; created (collectively) on first use.

    Creation is a collective over ``group``: every rank must call this with the same arguments in
    the same order (checked: a ValueError names the ranks whose shapes differ from rank 0's).
    Buffers are zeroed and the group is synchronized before anyone uses them, so a peer's first
    barrier signal can never be wiped by a late zero-fill.
    """
    group, name = _group_name(group)
    device = (
        torch.device(device)
        if device is not None
        else torch.device("cuda", torch.cuda.current_device())
    )
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device for symmetric memory, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (name, device, num_tokens, hidden, top_k, dtype, backward)
    ws = _CACHE.get(key)
    if ws is not None:
        return ws
    _validate(num_tokens, hidden, top_k, dtype)
    from torch.distributed import _symmetric_memory as symm_mem

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = workspace_bytes(num_tokens, hidden, top_k, world, dtype, backward)
    storage = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(storage, name)
    if handle.world_size != world or handle.rank != rank:
        raise RuntimeError(
            f"symmetric memory handle is rank {handle.rank} of {handle.world_size}, "
            f"the group says rank {rank} of {world}"
        )
    # The tensor may start inside its segment; the offset is the same on every rank because all
    # ranks allocate the same sizes in the same order. One collective checks that, and that every
    # rank asked for the same layout: symmetric layouts of different sizes would make the peer
    # kernels address the wrong memory.
    shift = storage.data_ptr() - handle.buffer_ptrs[rank]
    mine = (num_tokens, hidden, top_k, str(dtype), backward, nbytes, shift)
    layouts: list[Any] = [None] * world
    dist.all_gather_object(layouts, mine, group=group)
    _check_layouts(layouts)
    if shift < 0 or shift + nbytes > handle.buffer_size:
        raise RuntimeError(f"workspace tensor lies outside its symmetric segment (offset {shift})")
    bases = [p + shift for p in handle.buffer_ptrs]
    storage.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    ws = _assemble(storage, bases, rank, num_tokens, hidden, top_k, dtype, backward, handle, name)
    _CACHE[key] = ws
    return ws


_LAYOUT_FIELDS = ("num_tokens", "hidden", "top_k", "dtype", "backward", "nbytes", "shift")


def _check_layouts(layouts: list[tuple]) -> None:
    """Raise ValueError unless every rank's (T, H, K, dtype, backward, nbytes, shift) is
    rank 0's."""
    differ = [r for r, v in enumerate(layouts) if v != layouts[0]]
    if not differ:
        return
    lines = "; ".join(
        f"rank {r}: " + ", ".join(f"{f}={x}" for f, x in zip(_LAYOUT_FIELDS, layouts[r]))
        for r in [0, *differ]
    )
    raise ValueError(
        f"get_workspace: ranks {differ} asked for a different workspace than rank 0 "
        f"(every rank must call it with the same shapes in the same order): {lines}"
    )


def cached_workspaces(group: dist.ProcessGroup | None = None) -> list[Workspace]:
    """The cached workspaces of ``group`` (default: the world), in creation order."""
    if not dist.is_initialized():
        return []
    _, name = _group_name(group)
    return [ws for ws in _CACHE.values() if ws.group_name == name]


def clear_workspace_cache() -> None:
    """Forget every cached workspace (their memory is freed when no tensor refers to it).

    Also the way out of a :class:`StallError`: call it on every rank, then the next call builds
    a fresh workspace (a collective again) with barrier epochs in step.
    """
    _CACHE.clear()


# --------------------------------------------------------------------------------------------
# Host helpers


def publish(
    ws: Workspace,
    x: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    dy: torch.Tensor | None = None,
) -> None:
    """Copy this rank's inputs into its symmetric regions (stream-ordered, no host sync).

    Peers may read them only after the next barrier.
    """
    t, h, k = ws.num_tokens, ws.hidden, ws.top_k
    for name, value, shape, dst in (
        ("x", x, (t, h), ws.x_buffer),
        ("dy", dy, (t, h), ws.dy_buffer),
        ("topk_ids", topk_ids, (t, k), ws.routing_ids),
        ("topk_weights", topk_weights, (t, k), ws.routing_weights),
    ):
        if value is None:
            continue
        if dst is None:
            raise ValueError(f"{name}: this workspace was built with backward=False")
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(value.shape)}")
        dst.copy_(value)


def packed_buffer(ws: Workspace, width: int, source: str = "x") -> torch.Tensor:
    """The ``x_buffer`` (``source="x"``) or ``dy_buffer`` (``"dy"``) region as ``[T, width]``
    int16 rows (packed fp8 rows, at its start)."""
    if source not in ("x", "dy"):
        raise ValueError(f"source must be 'x' or 'dy', got {source!r}")
    region = ws.x_buffer if source == "x" else ws.dy_buffer
    if region is None:
        raise ValueError(f"{source}: this workspace was built with backward=False")
    t, words = ws.num_tokens, ws.hidden * ws.dtype.itemsize // 2
    if isinstance(width, bool) or not isinstance(width, int) or not 0 < width <= words:
        raise ValueError(
            f"width must be an int in [1, {words}] (int16 words of one {source}_buffer row), "
            f"got {width!r}"
        )
    return region.view(torch.int16).view(-1)[: t * width].view(t, width)


def packed_x_buffer(ws: Workspace, width: int) -> torch.Tensor:
    """The x_buffer region as ``[T, width]`` int16 rows (packed fp8 rows, at its start)."""
    return packed_buffer(ws, width, "x")


def publish_packed(
    ws: Workspace, x: torch.Tensor | None = None, dy: torch.Tensor | None = None
) -> None:
    """Quantize this rank's tokens ``x [T, H]`` (or its output gradient ``dy [T, H]``) 1x128
    straight into its x_buffer (dy_buffer) as packed fp8 rows (``fp8.quantize_packed``;
    stream-ordered, no host sync), so that the pull moves fp8 bytes and scales
    (``dispatch_pull(..., source, packed_width=fp8.packed_width(H))``): about half the bytes of
    bf16 rows. Peers may read them only after the next barrier."""
    from ..kernels import fp8  # (here: the workspace itself needs no Triton)

    t, h = ws.num_tokens, ws.hidden
    for name, value in (("x", x), ("dy", dy)):
        if value is None:
            continue
        if tuple(value.shape) != (t, h):
            raise ValueError(f"{name} must have shape {[t, h]}, got {list(value.shape)}")
        fp8.quantize_packed(value, out=packed_buffer(ws, fp8.packed_width(h), name))


def take_stall(
    ws: Workspace, words: list[int] | None = None, clear: bool = True
) -> StallError | None:
    """The one decoder of the stall record: a :class:`StallError` if ``words`` (the record as
    read from ``ws.errors``; read now, a host sync, when None) hold a stall, else None.

    With ``clear`` a set record is reset on the device, so that the same stall is not reported
    twice; that does not make the workspace usable again (see :class:`StallError`).
    """
    if words is None:
        words = ws.errors.tolist()
    if words[ErrorWord.FLAG] == 0:
        return None
    if clear:
        ws.errors.zero_()
    return StallError(describe_stall(words[:ERROR_WORDS]))


def check_errors(ws: Workspace, clear: bool = True) -> None:
    """Raise :class:`StallError` if a device spin-wait of this rank gave up since the last check.

    Reads the error record (a host sync): call it at check points, not inside a captured graph.
    With ``clear`` the record is reset (the stall is reported once). A stall is fatal and is
    recorded only on the rank that waited: drop the workspace on every rank
    (``clear_workspace_cache()``) and rebuild it.
    """
    err = take_stall(ws, clear=clear)
    if err is not None:
        raise err
