"""The FP8 copies of the expert weights (``MoEConfig(precision="fp8")``, docs/fp8.md).

Each weight the expert GEMMs read is quantized 128x128 once per value, with its transposed copy
for the data gradients (``fp8.quantize_weight(w, transposed=True)``), and reused by every
forward and backward until the weight changes: once per optimizer step, not per micro-batch.

An entry is keyed by the tensor's identity (device, data pointer, shape, strides, dtype) and
checked against its ``_version``, which every in-place write bumps (``optimizer.step()``,
``copy_``, ``add_`` under ``no_grad``): a changed weight is quantized again and replaces its
entry. One half of a stacked ``[E, 2I, H]`` gate/up weight is a view with its own data pointer,
so the halves are two entries, and their blocks never straddle gate and up. An entry keeps a
detached alias of its weight (the same storage and version counter), so that storage stays
allocated while the entry lives and no other tensor can take its address.

Writes that bypass the version counter (through ``param.data``, or from outside PyTorch) are not
seen: call :func:`clear` after them. While a CUDA graph is captured the cache is bypassed: every
weight is quantized inside the graph, so a replay after an optimizer step reads the new values
(a cached copy would be replayed stale). The forward takes a step's copies once
(:func:`step_weights`) and the backward reads the transposed ones from the saved context, so a
captured training step quantizes each weight once, as an eager one does at most.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from ..kernels import fp8
from ..types import ExpertWeights

__all__ = [
    "Fp8WeightCache",
    "capturing",
    "CACHE",
    "get",
    "clear",
    "MAX_ENTRIES",
    "StepWeights",
    "step_weights",
    "transposed_layout",
    "transposed_tensors",
    "from_transposed",
]

# Entries kept (least recently used dropped first): a model's expert weights of many layers.
MAX_ENTRIES = 1024

_Key = tuple[torch.device, int, tuple[int, ...], tuple[int, ...], torch.dtype]


class _Entry(NamedTuple):
    version: int
    alias: torch.Tensor  # keeps the storage (and so the address) of the key alive
    weight: fp8.Fp8Weight


def capturing(w: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``w``'s device (then the cache is bypassed)."""
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


class Fp8WeightCache:
    """Weight -> its ``Fp8Weight`` with the transposed copy, quantized once per version.

    ``quantizations`` counts the weights quantized (misses), for tests and accounting."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.quantizations = 0
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, w: torch.Tensor) -> fp8.Fp8Weight:
        """``w [E, N, K]`` (any strides) quantized 128x128, with ``q_t`` and ``scale_t``."""
        if capturing(w):
            with torch.no_grad():  # in the graph: every replay quantizes the current values
                return fp8.quantize_weight(w.detach(), transposed=True)
        key = (w.device, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype)
        entry = self._entries.get(key)
        if entry is not None and entry.version == w._version:
            self._entries.move_to_end(key)
            return entry.weight
        with torch.no_grad():
            alias = w.detach()
            weight = fp8.quantize_weight(alias, transposed=True)
        self.quantizations += 1
        self._entries[key] = _Entry(w._version, alias, weight)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return weight

    def clear(self) -> None:
        """Drop every entry (the next use of each weight quantizes it again)."""
        self._entries.clear()


# The process's cache, used by the expert GEMMs.
CACHE = Fp8WeightCache()


def get(w: torch.Tensor) -> fp8.Fp8Weight:
    """:meth:`Fp8WeightCache.get` of the process's cache."""
    return CACHE.get(w)


def clear() -> None:
    """Empty the process's cache (after writes that bypass ``_version``, e.g. ``param.data``)."""
    CACHE.clear()


class StepWeights(NamedTuple):
    """One step's fp8 copies of an expert group's weights (each an ``Fp8Weight`` with its
    transposed copy): the routed experts' and the shared expert's (None without one). The
    forward reads q and scale; the backward reads q_t and scale_t, and a context restored from
    its saved tensors holds only those (q and scale None)."""

    gate: fp8.Fp8Weight
    up: fp8.Fp8Weight
    down: fp8.Fp8Weight
    s_gate: fp8.Fp8Weight | None = None
    s_up: fp8.Fp8Weight | None = None
    s_down: fp8.Fp8Weight | None = None


def step_weights(weights: ExpertWeights) -> StepWeights:
    """Every expert weight of ``weights`` (gate and up as their two [E, I, H] halves) from
    :func:`get`; the shared expert's as one-expert weights."""
    shared = (
        (get(weights.s_gate[None]), get(weights.s_up[None]), get(weights.s_down[None]))
        if weights.has_shared
        else ()
    )
    return StepWeights(get(weights.w_gate), get(weights.w_up), get(weights.w_down), *shared)


def transposed_layout(
    experts: int, hidden: int, intermediate: int, shared_intermediate: int
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of each tensor :func:`transposed_tensors` returns: q_t [E, K, N]
    and scale_t of gate, up and down, and of the shared expert's when ``shared_intermediate``."""

    def cdiv(a: int) -> int:
        return -(-a // fp8.BLOCK)

    out = []
    groups = [("", experts, intermediate)]
    if shared_intermediate:
        groups.append(("s_", 1, shared_intermediate))
    for prefix, e, i in groups:
        for name, n, k in (("gate", i, hidden), ("up", i, hidden), ("down", hidden, i)):
            out.append((f"fp8_{prefix}{name}_q_t", (e, k, n), torch.uint8))
            out.append((f"fp8_{prefix}{name}_scale_t", (e, cdiv(k), cdiv(n)), torch.float32))
    return out


def transposed_tensors(weights: StepWeights) -> list[torch.Tensor]:
    """What the backward reads of ``weights``, as a flat list (:func:`transposed_layout`; the
    fp8 bytes as uint8, which every op of a custom op's checks takes: the same memory)."""
    return [t for w in weights if w is not None for t in (w.q_t.view(torch.uint8), w.scale_t)]


def from_transposed(tensors: list[torch.Tensor]) -> StepWeights:
    """The :class:`StepWeights` of :func:`transposed_tensors`' list (q and scale None)."""
    pairs = zip(tensors[::2], tensors[1::2])
    return StepWeights(*(fp8.Fp8Weight(None, None, q.view(fp8.FP8), s) for q, s in pairs))
