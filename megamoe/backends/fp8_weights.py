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
(a cached copy would be replayed stale).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from ..kernels import fp8

__all__ = ["Fp8WeightCache", "CACHE", "get", "clear", "MAX_ENTRIES"]

# Entries kept (least recently used dropped first): a model's expert weights of many layers.
MAX_ENTRIES = 1024

_Key = tuple[torch.device, int, tuple[int, ...], tuple[int, ...], torch.dtype]


class _Entry(NamedTuple):
    version: int
    alias: torch.Tensor  # keeps the storage (and so the address) of the key alive
    weight: fp8.Fp8Weight


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
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
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
