"""The frozen MoE configuration and every check on its shape and tunables.

One place validates: modules, functional calls and the CLI build a :class:`MoEConfig` and trust
it afterwards, so a bad value is reported once, with its name, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["MoEConfig", "TUNABLES", "PRECISIONS", "FP8_BLOCK", "FP8_SIZE_MULTIPLE", "require_int"]

# The config fields that change speed, never results (MoEConfig's docstring): benchmark records
# carry them and `megamoe bench --tune` sweeps them.
TUNABLES: tuple[str, ...] = (
    "comm_programs",
    "push_programs",
    "minibatch_rows",
    "ring_rows",
    "down_lag",
    "copy_programs",
    "overlap_shared",
    "comm_kernel",
)
# The expert GEMMs' number formats (``MoEConfig.precision``; docs/fp8.md). Not a tunable: "fp8"
# changes results.
PRECISIONS: tuple[str, ...] = ("bf16", "fp8")
# fp8: the scale block (the weight gradient's 128-row steps must lie inside one block row) ...
FP8_BLOCK = 128
# ... and the size multiple of H and I (16-byte fp8 TMA rows).
FP8_SIZE_MULTIPLE = 16
# The GEMM tile height that pads each expert's rows; the Triton kernels use it too.
DEFAULT_BLOCK_ROWS = 128


def require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _as_bool(name: str, value: Any) -> bool:
    """A bool tunable: True / False, or the ints 1 / 0 (``--set`` and ``--tune`` give ints)."""
    if isinstance(value, bool):
        return value
    if type(value) is not int:
        raise TypeError(f"{name} must be a bool (or 0 / 1), got {value!r}")
    if value not in (0, 1):
        raise ValueError(f"{name} must be a bool (or 0 / 1), got {value}")
    return bool(value)


def _require_multiple(name: str, value: int, base_name: str, base: int) -> None:
    """``value`` (an int >= ``base``) must be a whole number of ``base``-sized pieces."""
    require_int(name, value, base)
    if value % base:
        raise ValueError(f"{name} must be a multiple of {base_name} ({base}), got {value}")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: its shape, then the kernels' tunables (speed only, never results).

    Shape: ``num_experts`` is the *global* expert count; with expert parallelism over W ranks
    each rank owns ``num_experts // W`` consecutive experts (rank r owns
    ``[r*E_local, (r+1)*E_local)``). ``shared_intermediate_size == 0`` means no shared expert.
    ``block_rows`` is the GEMM tile height each expert's rows are padded to, and
    ``capacity_factor`` bounds the rows a rank may receive as a multiple of the balanced load
    ``T * top_k`` (None: the worst case, every token of every rank).

    Tunables (docs/tuning.md has each one's default, derivation and trade-off):
      comm_programs   backend "fused": programs that move rows (pull programs of the one-kernel
                      forward, or the comm kernel's programs); None: derived
      minibatch_rows  backend "fused": rows per readiness counter and per task-list group
      ring_rows       backend "fused": rows of the routed-token ring buffer; None: every row
                      (the routed activations are saved); fewer: bounded memory, the backward
                      replays the routed forward
      down_lag        backend "fused": task-list groups between a group's gate/up tiles and its
                      down tiles; None: derived
      comm_kernel     backend "fused": pulls and pushes in a second kernel beside the compute
                      kernel; None: on when the ring holds every row
      push_programs   backend "fused"'s pipelined fp8 forward: comm programs that push z beside
                      the down GEMM, each on an SM of its own; None: derived
      copy_programs   programs of the standalone NVLink copies (backend "triton"'s dispatch
                      pull, combine push and their backward; backend "fused"'s backward)
      overlap_shared  W > 1: the shared expert's GEMMs on a second stream beside those copies
                      (an int 0 / 1 is accepted)

    ``precision`` is not a tunable (it changes results): "bf16" (default) or "fp8", the
    expert GEMMs on block-scaled E4M3 operands (docs/fp8.md). "fp8"
    needs ``block_rows`` a multiple of 128 and hidden, intermediate and shared intermediate
    sizes multiples of 16. ``fp8_weight_cache`` (fp8): keep each expert weight's fp8 copies
    from call to call until the weight changes (default), or quantize them in every forward and
    backward, each in the one layout it reads (False): for weights gathered or converted anew
    in each call (FSDP-sharded experts, a cast from fp32), whose cached copies would pile up
    (docs/fp8.md, "Weights").
    ``MoE`` and the integrations turn it off for FSDP-sharded weights.
    """

    # shape
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    shared_intermediate_size: int = 0
    # tunables
    comm_programs: int | None = None
    copy_programs: int = 24
    minibatch_rows: int = 1024
    ring_rows: int | None = None
    # shape of the row layout and of the expert-parallel buffers
    block_rows: int = DEFAULT_BLOCK_ROWS
    capacity_factor: float | None = None
    # tunables
    down_lag: int | None = None
    overlap_shared: bool = True
    comm_kernel: bool | None = None
    push_programs: int | None = None
    # number format of the expert GEMMs (changes results)
    precision: str = "bf16"
    # fp8: keep the weights' fp8 copies from call to call (False: quantize in every forward)
    fp8_weight_cache: bool = True

    def __post_init__(self) -> None:
        require_int("hidden_size", self.hidden_size, 1)
        require_int("intermediate_size", self.intermediate_size, 1)
        require_int("num_experts", self.num_experts, 1)
        require_int("top_k", self.top_k, 1)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be <= num_experts ({self.num_experts}), got {self.top_k}")
        require_int("shared_intermediate_size", self.shared_intermediate_size, 0)
        if self.comm_programs is not None:
            require_int("comm_programs", self.comm_programs, 1)
        require_int("copy_programs", self.copy_programs, 1)
        if self.push_programs is not None:
            require_int("push_programs", self.push_programs, 1)
        require_int("block_rows", self.block_rows, 16)
        if self.block_rows & (self.block_rows - 1):
            raise ValueError(f"block_rows must be a power of two, got {self.block_rows}")
        _require_multiple("minibatch_rows", self.minibatch_rows, "block_rows", self.block_rows)
        if self.ring_rows is not None:
            _require_multiple("ring_rows", self.ring_rows, "minibatch_rows", self.minibatch_rows)
        if self.down_lag is not None:
            require_int("down_lag", self.down_lag, 0)
        object.__setattr__(self, "overlap_shared", _as_bool("overlap_shared", self.overlap_shared))
        object.__setattr__(
            self, "fp8_weight_cache", _as_bool("fp8_weight_cache", self.fp8_weight_cache)
        )
        if self.comm_kernel is not None:
            object.__setattr__(self, "comm_kernel", _as_bool("comm_kernel", self.comm_kernel))
        if self.capacity_factor is not None:
            cf = self.capacity_factor
            if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf >= 1.0:
                raise ValueError(f"capacity_factor must be a number >= 1.0 or None, got {cf!r}")
        self._check_precision()
        # The config as a string (not a field): how it travels through the custom ops.
        object.__setattr__(self, "key", json.dumps(dataclasses.asdict(self), sort_keys=True))

    def _check_precision(self) -> None:
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.precision != "fp8":
            return
        if self.block_rows % FP8_BLOCK:
            raise ValueError(
                f"precision 'fp8' needs block_rows to be a multiple of {FP8_BLOCK} (the weight "
                f"gradient's 128-row scale blocks inside one expert), got {self.block_rows}"
            )
        for name in ("hidden_size", "intermediate_size", "shared_intermediate_size"):
            value = getattr(self, name)
            if value % FP8_SIZE_MULTIPLE:
                raise ValueError(
                    f"precision 'fp8' needs {name} to be a multiple of {FP8_SIZE_MULTIPLE} "
                    f"(16-byte fp8 TMA rows), got {value}"
                )

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def from_key(key: str) -> "MoEConfig":
        """The config whose :attr:`key` this is."""
        return MoEConfig(**json.loads(key))

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_intermediate_size > 0

    def local_experts(self, world_size: int) -> int:
        """Experts owned by each of ``world_size`` ranks; they must divide evenly."""
        require_int("world_size", world_size, 1)
        if self.num_experts % world_size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by the expert-parallel "
                f"world size, got world_size={world_size}"
            )
        return self.num_experts // world_size

    def capacity_rows(self, tokens_per_rank: int, world_size: int) -> int:
        """Routed rows one rank must be able to hold (before tile padding)."""
        worst = tokens_per_rank * self.top_k * world_size
        if self.capacity_factor is None:
            return worst
        balanced = tokens_per_rank * self.top_k
        return min(worst, int(balanced * self.capacity_factor + 0.999999))

    def replace(self, **changes: Any) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    def flops_per_token(self) -> int:
        """Forward FLOPs of one token: 6*H*I per routed (token, k) plus 6*H*Is shared."""
        h = self.hidden_size
        return 6 * h * (self.intermediate_size * self.top_k + self.shared_intermediate_size)
