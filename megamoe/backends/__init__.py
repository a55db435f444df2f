"""Backend registry: the adapters behind ``megamoe.functional``.

A backend is a module with three functions, the split of docs/design.md::

    build_schedule(topk_ids, config, group) -> schedule          (once per step)
    forward(x, topk_ids, topk_weights, weights, config, group, schedule) -> (y, ctx)
    backward(ctx, grad_y) -> MoEGrads

plus ``is_available(device) -> (bool, reason)``, ``MAX_WORLD_SIZE`` (None: any) and optionally
``supports(config, dtype) -> (bool, reason)`` for shapes or dtypes its kernels do not handle.
``ctx`` is whatever the backend needs for its backward; the functional API treats it as opaque.
For the custom ops of ``megamoe.ops`` a backend also flattens it: ``save(ctx) -> [tensors]``,
``restore(saved, x, topk_ids, topk_weights, weights, config, group) -> ctx`` and
``saved_layout(config, tokens, world_size, dtype) -> [(name, shape, dtype)]`` (what ``save``
returns, for the ops' fake implementations).
Backends are imported lazily so that the package imports on machines without Triton or a GPU.

The Triton backends ("triton", "fused") are thin adapters over shared modules: ``requirements``
(what the kernels need), ``state`` (schedule and context), ``experts`` (the expert GEMM calls),
``steps`` (the expert-parallel protocol, written once for every world size) and ``streams``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ..config import MoEConfig

__all__ = [
    "BACKENDS",
    "BACKEND_PRECISIONS",
    "check_precision",
    "precision_reason",
    "get_backend",
    "available_backends",
    "resolve_backend",
    "auto_order",
]

# name -> module path (listing order).
BACKENDS: dict[str, str] = {
    "triton": "megamoe.backends.triton",
    "fused": "megamoe.backends.fused",
    "reference": "megamoe.backends.reference",
}
# name -> the MoEConfig.precision values it runs (docs/fp8.md).
BACKEND_PRECISIONS: dict[str, tuple[str, ...]] = {
    "triton": ("bf16", "fp8"),
    "fused": ("bf16", "fp8"),
    "reference": ("bf16", "fp8"),  # fp8: the recipe in torch ops (megamoe.reference)
}

# backend="auto" takes the first available backend of these, by world size and, on one GPU, by
# the layer's shape and rows (docs/tuning.md, "backend auto", has the rule's data).
_AUTO_ONE_GPU = ("triton", "fused", "reference")
_AUTO_ONE_GPU_WIDE = ("fused", "triton", "reference")
_AUTO_EXPERT_PARALLEL = ("fused", "triton", "reference")
# In fp8 backend "triton" first at every world size: its GEMMs are the warp-specialized Gluon
# kernels, the fused forward's the Triton tiles (BENCHMARKS.md, "The fused forward in fp8").
_AUTO_FP8 = ("triton", "fused", "reference")
# On one GPU the fused forward beats the unfused one where the expert GEMMs are wide (its fixed
# cost, about 1 ms of host and start-up time, then hides): hidden x intermediate at least this
# (DeepSeek-V3's 7168 x 2048 and wider; GLM-4.5's 5120 x 1536 and narrower go unfused) ...
AUTO_FUSED_MIN_WEIGHT_ELEMENTS = 12 * 2**20
# ... and at least this many routed rows (tokens x top-k) to fill them, a full 128-row block
# per expert when balanced (Kimi-K2 at 4096 tokens, 85 rows per expert: `triton` 1-3% ahead).
AUTO_FUSED_MIN_ROWS = 8192
AUTO_FUSED_MIN_ROWS_PER_EXPERT = 128


def auto_order(
    world_size: int, config: MoEConfig | None = None, tokens: int | None = None
) -> tuple[str, ...]:
    """The backends backend="auto" tries at this expert-parallel world size, best first; on
    one GPU, given the config and the tokens of the step, "fused" first for wide layers."""
    if config is not None and config.precision == "fp8":
        return _AUTO_FP8
    if world_size > 1:
        return _AUTO_EXPERT_PARALLEL
    if config is not None and tokens is not None:
        wide = config.hidden_size * config.intermediate_size >= AUTO_FUSED_MIN_WEIGHT_ELEMENTS
        rows = tokens * config.top_k
        full = rows >= AUTO_FUSED_MIN_ROWS_PER_EXPERT * config.num_experts
        if wide and rows >= AUTO_FUSED_MIN_ROWS and full:
            return _AUTO_ONE_GPU_WIDE
    return _AUTO_ONE_GPU


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS) + ['auto']}, got {name!r}")
    return importlib.import_module(BACKENDS[name])


def precision_reason(name: str, precision: str) -> str | None:
    """Why backend ``name`` does not run ``precision``; None when it does."""
    if precision in BACKEND_PRECISIONS[name]:
        return None
    runs = [n for n, p in BACKEND_PRECISIONS.items() if precision in p]
    return (
        f"backend {name!r} does not run precision {precision!r} (it runs "
        f"{list(BACKEND_PRECISIONS[name])}); precision {precision!r} runs on backend "
        f"{' or '.join(repr(n) for n in runs)}"
    )


def _precision_reason(name: str, config: MoEConfig | None) -> str | None:
    """Why backend ``name`` does not run ``config.precision``; None when it does."""
    return None if config is None else precision_reason(name, config.precision)


def check_precision(name: str, config: MoEConfig | None) -> None:
    """Raise ValueError when backend ``name`` does not run ``config.precision``."""
    reason = _precision_reason(name, config)
    if reason is not None:
        raise ValueError(reason)


def _availability(
    name: str,
    device: torch.device | None,
    world_size: int,
    config: MoEConfig | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[bool, str]:
    try:
        module = get_backend(name)
    except ImportError as exc:  # e.g. triton missing
        return False, f"import failed: {exc}"
    limit = getattr(module, "MAX_WORLD_SIZE", None)
    if limit is not None and world_size > limit:
        return False, f"supports expert-parallel world sizes up to {limit}, got {world_size}"
    precision = _precision_reason(name, config)
    if precision is not None:
        return False, precision
    ok, reason = module.is_available(device)
    if ok and config is not None and hasattr(module, "supports"):
        ok, reason = module.supports(config, dtype)
    return ok, reason


def available_backends(
    device: torch.device | None = None,
    world_size: int = 1,
    config: MoEConfig | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, tuple[bool, str]]:
    """name -> (available, reason) for ``device`` (default: CUDA if present, else CPU), and for
    ``config``/``dtype`` when given."""
    return {name: _availability(name, device, world_size, config, dtype) for name in BACKENDS}


def resolve_backend(
    name: str,
    device: torch.device,
    world_size: int = 1,
    config: MoEConfig | None = None,
    dtype: torch.dtype | None = None,
    tokens: int | None = None,
) -> str:
    """Map "auto" to the best backend available on ``device`` at this expert-parallel size
    (:func:`auto_order`; and for this config, dtype and step's tokens when given); check an
    explicit name. Both Triton backends give the same bits, so auto's choice never changes
    results."""
    if name == "auto":
        for candidate in auto_order(world_size, config, tokens):
            if _availability(candidate, device, world_size, config, dtype)[0]:
                return candidate
        if config is not None and config.precision != "bf16":
            raise RuntimeError(
                f"no megamoe backend running precision {config.precision!r} is available on "
                f"{device}: {_availability('triton', device, world_size, config, dtype)[1]}"
            )
        raise RuntimeError("no megamoe backend is available")  # reference is always available
    get_backend(name)  # raises for an unknown name
    check_precision(name, config)
    ok, reason = _availability(name, device, world_size, config, dtype)
    if not ok and not _interpreted(name, device, world_size, config, dtype):
        raise RuntimeError(f"backend {name!r} is not available on {device}: {reason}")
    return name


def _interpreted(
    name: str,
    device: torch.device,
    world_size: int,
    config: MoEConfig | None,
    dtype: torch.dtype | None,
) -> bool:
    """A Triton backend named explicitly on the CPU under ``TRITON_INTERPRET=1`` runs in the
    interpreter (the tests; "auto" never picks it there)."""
    if name not in ("triton", "fused") or torch.device(device).type != "cpu":
        return False
    from ..kernels.runtime import interpreting

    module = get_backend(name)
    return interpreting() and (config is None or module.supports(config, dtype)[0])
