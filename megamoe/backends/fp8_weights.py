"""The FP8 copies of the expert weights (``MoEConfig(precision="fp8")``, docs/fp8.md).

Each weight the expert GEMMs read is quantized 128x128 once per value, with its transposed copy
for the data gradients (``fp8.quantize_weight(w, transposed=True)``), and reused by every
forward and backward until the weight changes: once per optimizer step, not per micro-batch.

An entry is keyed by the tensor's identity (device, data pointer, shape, strides, dtype) and
checked against its ``_version``, which every in-place write bumps (``optimizer.step()``,
``copy_``, ``add_`` under ``no_grad``), and against its storage: a changed weight is quantized
again and replaces its entry. One half of a stacked ``[E, 2I, H]`` gate/up weight is a view with
its own data pointer, so the halves are two entries, and their blocks never straddle gate and
up. An entry keeps a detached alias of its weight (the same storage and version counter), so
that storage stays allocated while the entry lives and no other tensor can take its address.

Not every write bumps the version: FSDP2 writes each all-gather into the unsharded parameters
with their version counters preserved, and frees that memory after the forward (the storage
resized to nothing, so its address can come back, also to another storage). So a hit also needs
the same storage, and every cache empties after each ``torch.optim`` optimizer step (a global
step hook, registered with the first entry). Weights gathered or cast anew for each call
(FSDP-sharded experts, a cast from fp32) are best not cached at all (each forward quantizes
the layout it reads, and each backward the transposed one), or their copies pile up until the
step ends:
``MoEConfig.fp8_weight_cache`` False, which ``MoE`` and the integrations set for FSDP-sharded
weights (and the torchtitan one for cast ones). After other writes that bypass the version
(through ``param.data``, from outside PyTorch, a checkpoint loaded into FSDP's shards) call
:func:`clear`.

While a CUDA graph is captured the cache is bypassed: every weight is quantized inside the
graph, so a replay after an optimizer step reads the new values (a cached copy would be replayed
stale). The forward takes a step's copies once (:func:`step_weights`) and the backward reads the
transposed ones from the saved context (with the cache on), so a captured training step
quantizes each weight once, as an eager one does at most.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # (a torch without torch.distributed)
    FSDPModule = None

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
    "views",
    "gathered_per_call",
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
    # written by the optimizer's update (:meth:`Fp8WeightCache.put`): kept through optimizer
    # steps, which empty every other entry
    from_update: bool = False


def _key(w: torch.Tensor) -> _Key:
    return (w.device, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype)


def capturing(w: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``w``'s device (then the cache is bypassed)."""
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share one storage: an address alone can be another storage's
    once the first was resized to nothing (FSDP2 frees its gathered weights so)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


# Every live cache, emptied after each optimizer step (:func:`_empty_after_optimizer_steps`).
_CACHES: "weakref.WeakSet[Fp8WeightCache]" = weakref.WeakSet()
_STEP_HOOK = None  # the handle of that hook, once registered


def _empty_caches(*_) -> None:
    for cache in list(_CACHES):
        cache.clear(keep_updates=True)


def _empty_after_optimizer_steps() -> None:
    """Register (once) the global ``torch.optim`` step hook that empties every cache: a step
    changes the weights, also where their version counters do not show it (FSDP2)."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_post_hook(_empty_caches)


class Fp8WeightCache:
    """Weight -> its ``Fp8Weight`` with the transposed copy, quantized once per version and
    optimizer step.

    ``quantizations`` counts the weights quantized (misses), for tests and accounting."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.quantizations = 0
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        _CACHES.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, w: torch.Tensor, cache: bool = True, backward: bool = False) -> fp8.Fp8Weight:
        """``w [E, N, K]`` (any strides) quantized 128x128, with ``q_t`` and ``scale_t``;
        ``cache`` False: quantized now and not kept (a weight gathered for this call), only
        the layout the pass reads: q and scale for a forward, q_t and scale_t for a
        ``backward``."""
        if not cache:
            with torch.no_grad():
                return fp8.quantize_weight(w.detach(), transposed=backward, plain=not backward)
        if capturing(w):
            with torch.no_grad():  # (in a graph: every replay quantizes the current values)
                return fp8.quantize_weight(w.detach(), transposed=True)
        key = _key(w)
        entry = self._entries.get(key)
        if entry is not None and entry.version == w._version and _same_storage(entry.alias, w):
            self._entries.move_to_end(key)
            return entry.weight
        with torch.no_grad():
            alias = w.detach()
            weight = fp8.quantize_weight(alias, transposed=True)
        self.quantizations += 1
        self._insert(key, _Entry(w._version, alias, weight))
        return weight

    def put(self, w: torch.Tensor, weight: fp8.Fp8Weight) -> None:
        """Keep ``weight`` (with its transposed copy) as the copy of ``w`` at its current
        version: what the optimizer's update wrote (``megamoe.optim.AdamW``). Such an entry
        outlives optimizer steps (the version and storage checks still apply)."""
        if weight.q is None or weight.q_t is None:
            raise ValueError("put needs an Fp8Weight with both layouts (q and q_t)")
        self._insert(_key(w), _Entry(w._version, w.detach(), weight, from_update=True))

    def _insert(self, key: _Key, entry: _Entry) -> None:
        _empty_after_optimizer_steps()
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self, keep_updates: bool = False) -> None:
        """Drop every entry (the next use of each weight quantizes it again); with
        ``keep_updates``, all but those the optimizer's update wrote (:meth:`put`)."""
        if keep_updates:
            for key in [k for k, e in self._entries.items() if not e.from_update]:
                del self._entries[key]
        else:
            self._entries.clear()


# The process's cache, used by the expert GEMMs.
CACHE = Fp8WeightCache()


def get(w: torch.Tensor, cache: bool = True, backward: bool = False) -> fp8.Fp8Weight:
    """:meth:`Fp8WeightCache.get` of the process's cache."""
    return CACHE.get(w, cache, backward)


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


def views(weights: ExpertWeights) -> list[torch.Tensor]:
    """The [E, N, K] tensors of ``weights`` that the layer quantizes, as the cache keys them:
    gate, up (a stacked weight's two halves) and down, then the shared expert's as one-expert
    weights (``s_gate[None]``, ...)."""
    weights = weights.split_gate_up()
    ws = [weights.w_gate, weights.w_up, weights.w_down]
    if weights.has_shared:
        ws += [weights.s_gate[None], weights.s_up[None], weights.s_down[None]]
    return ws


def step_weights(weights: ExpertWeights, cache: bool = True, backward: bool = False) -> StepWeights:
    """Every expert weight of ``weights`` (:func:`views`) from :func:`get` (``cache``:
    ``MoEConfig.fp8_weight_cache``; ``backward``: uncached, only the transposed copies)."""
    return StepWeights(*(get(w, cache, backward) for w in views(weights)))


def gathered_per_call(module: torch.nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) shards ``module``'s parameters and gathers them anew for
    each forward: then their fp8 copies are not cached (``MoEConfig.fp8_weight_cache``)."""
    return FSDPModule is not None and isinstance(module, FSDPModule)


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
