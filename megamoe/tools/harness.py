"""What every tool shares: the distributed set-up, the shape and case arguments, and the case.

A tool's ``main`` is: :func:`add_case_arguments` (``--preset/--model/--shape/--tokens/
--routing/--seed/--set``), ``env = init_distributed()``, ``shape, case, config =
case_of_args(args, parser, env)``, the tool's own work, ``finish_distributed(env)``.

Shapes: a benchmark preset (``megamoe.shapes.PRESETS``: local experts per rank), a model of
``megamoe.shapes.MODEL_SHAPES`` (global experts, divided over the ranks) or a custom
``H,I,E,K[,Is]`` (global experts).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import functional
from ..config import TUNABLES, MoEConfig
from ..shapes import MODEL_SHAPES, PRESETS
from ..types import ExpertWeights
from .baselines import torch_a2a_moe
from .routing import ROUTING_KINDS, make_routing

__all__ = [
    "BASELINE",
    "DistEnv",
    "init_distributed",
    "finish_distributed",
    "BenchShape",
    "resolve_shape",
    "add_case_arguments",
    "shapes_of",
    "add_set_argument",
    "apply_settings",
    "Case",
    "make_case",
    "layer_fn",
    "layer_call",
    "DEFAULT_SEED",
]

BASELINE = "torch-a2a"
DEFAULT_SEED = 1234
# Default tokens per rank of a model or custom shape (a preset has its own).
DEFAULT_TOKENS = 4096
_RANK_SEED_STRIDE = 7919


# --------------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class DistEnv:
    """Where this process runs: expert-parallel group (None for one process) and device."""

    world_size: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistEnv:
    """One process: no group. Under torchrun with WORLD_SIZE > 1: NCCL per GPU, else gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world <= 1:
        return DistEnv(device=device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", device_id=device if use_cuda else None
        )
    return DistEnv(dist.get_world_size(), dist.get_rank(), device, dist.group.WORLD)


def finish_distributed(env: DistEnv, code: int = 0) -> int:
    """End of a torchrun tool that has done its work: wait for every rank, then tear the group
    down; returns ``code``. On gloo (CPU ranks) the process ends here instead, with ``code``
    and its output flushed, without tearing gloo down: gloo's teardown aborted a rank now and
    then (std::terminate in its threads, after the tool's output was complete), which turned a
    finished run into a failed one."""
    if env.group is None:
        return code
    dist.barrier(group=env.group)
    if dist.get_backend(env.group) == "gloo":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    dist.destroy_process_group()
    return code


# ------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class BenchShape:
    """A layer shape to run: ``kind`` "preset" (local experts), "model" or "custom" (global)."""

    name: str
    kind: str
    hidden_size: int
    intermediate_size: int
    experts: int  # local experts of a preset, global experts otherwise
    top_k: int
    shared_intermediate_size: int
    tokens_per_rank: int = DEFAULT_TOKENS

    def config(self, world_size: int = 1, **tunables: Any) -> MoEConfig:
        """The layer's config at ``world_size`` (a ValueError if the experts do not divide)."""
        experts = self.experts * world_size if self.kind == "preset" else self.experts
        cfg = MoEConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_experts=experts,
            top_k=self.top_k,
            shared_intermediate_size=self.shared_intermediate_size,
            **tunables,
        )
        cfg.local_experts(world_size)
        return cfg

    def record_fields(self) -> dict[str, Any]:
        """``preset`` and ``model`` ("custom" for a custom shape) of a record."""
        return {
            "preset": self.name if self.kind == "preset" else None,
            "model": None
            if self.kind == "preset"
            else ("custom" if self.kind == "custom" else self.name),
        }


def _custom(spec: str) -> BenchShape:
    try:
        values = [int(v) for v in spec.split(",")]
    except ValueError:
        values = []
    if len(values) not in (4, 5):
        raise ValueError(f"shape must be H,I,E,K[,Is] (integers), got {spec!r}")
    h, i, e, k, i_s = (*values, 0) if len(values) == 4 else values
    MoEConfig(h, i, e, k, i_s)  # names a bad value
    return BenchShape(f"custom {spec}", "custom", h, i, e, k, i_s)


def _shape_of(layer, kind: str, experts: int, tokens: int = DEFAULT_TOKENS) -> BenchShape:
    return BenchShape(
        layer.name,
        kind,
        layer.hidden_size,
        layer.intermediate_size,
        experts,
        layer.top_k,
        layer.shared_intermediate_size,
        tokens,
    )


def resolve_shape(spec: str | BenchShape) -> BenchShape:
    """A preset name, a model name (``megamoe.shapes``) or ``H,I,E,K[,Is]``."""
    if isinstance(spec, BenchShape):
        return spec
    if spec in PRESETS:
        p = PRESETS[spec]
        return _shape_of(p, "preset", p.local_experts, p.tokens_per_rank)
    if spec in MODEL_SHAPES:
        return _shape_of(MODEL_SHAPES[spec], "model", MODEL_SHAPES[spec].num_experts)
    if "," in spec:
        return _custom(spec)
    raise ValueError(
        f"shape must be a preset ({', '.join(PRESETS)}), a model "
        f"({', '.join(MODEL_SHAPES)}) or H,I,E,K[,Is], got {spec!r}"
    )


def add_case_arguments(
    parser: argparse.ArgumentParser, *, many: bool = False, default_preset: str | None = "dsv3"
) -> None:
    """``--preset``, ``--model``, ``--shape``, ``--tokens``, ``--routing``, ``--seed`` and
    ``--set``; ``many``: several of each shape option and several token counts."""
    nargs = dict(action="extend", nargs="+") if many else {}
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        **nargs,
        help="benchmark preset (local experts per rank)"
        + (f"; default {default_preset}" if default_preset else ""),
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODEL_SHAPES) + (["all"] if many else []),
        **nargs,
        help="a model's layer from megamoe.shapes.MODEL_SHAPES (experts / W per "
        "rank); 'all' is every model"
        if many
        else "a model's layer from megamoe.shapes.MODEL_SHAPES",
    )
    parser.add_argument(
        "--shape",
        metavar="H,I,E,K[,Is]",
        **nargs,
        help="a custom layer: hidden, intermediate, global experts, top-k and "
        "the shared expert's intermediate size",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        **(dict(nargs="+") if many else {}),
        help=f"tokens per rank (default: the preset's, else {DEFAULT_TOKENS})",
    )
    parser.add_argument("--routing", choices=ROUTING_KINDS, default="uniform")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    add_set_argument(parser)
    parser.set_defaults(_default_preset=default_preset)


def shapes_of(args: argparse.Namespace) -> list[BenchShape]:
    """The shapes the case arguments name, in order (presets, models, custom); the default
    preset when none is named."""

    def listed(value) -> list[str]:
        return [] if value is None else [value] if isinstance(value, str) else list(value)

    models = listed(args.model)
    if "all" in models:
        models = [m for m in models if m != "all"] + list(MODEL_SHAPES)
    names = listed(args.preset) + models + listed(args.shape)
    if not names and args._default_preset:
        names = [args._default_preset]
    return [resolve_shape(n) for n in dict.fromkeys(names)]


def case_of_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser, env: DistEnv
) -> tuple[BenchShape, Case, MoEConfig]:
    """The first shape the arguments name, its case on this rank and its config with every
    ``--set`` applied: what a one-shape tool runs."""
    shape = shapes_of(args)[0]
    case = make_case(shape, env, tokens=args.tokens, routing=args.routing, seed=args.seed)
    return shape, case, apply_settings(case.config, args.set, parser)


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set NAME=VALUE`` (repeatable): a config tunable for one run ('auto' = None)."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"a config tunable ({', '.join(TUNABLES)}; 'auto' = None)",
    )


def apply_settings(
    config: MoEConfig, specs: list[str], parser: argparse.ArgumentParser
) -> MoEConfig:
    """The config with every ``--set`` applied; a bad name or value is a usage error."""
    for spec in specs:
        name, _, value = spec.partition("=")
        if name not in TUNABLES:
            parser.error(f"--set: the tunable must be one of {list(TUNABLES)}, got {name!r}")
        try:
            config = config.replace(**{name: None if value == "auto" else int(value)})
        except (TypeError, ValueError) as exc:
            parser.error(f"--set {spec}: {exc}")
    return config


# ------------------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One shape's inputs on this rank: the same for every backend."""

    shape: BenchShape
    config: MoEConfig
    tokens: int
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    grad_y: torch.Tensor
    weights: ExpertWeights  # leaves that require grad

    def leaves(self) -> list[torch.Tensor]:
        return [self.x, self.topk_weights, *(w for w in self.weights if w is not None)]

    def inputs(self) -> tuple:
        """(x, topk_ids, topk_weights, weights, grad_y): ``testing.run_with_grads``' inputs."""
        return self.x, self.topk_ids, self.topk_weights, self.weights, self.grad_y


def make_case(
    shape: str | BenchShape,
    env: DistEnv,
    *,
    tokens: int | None = None,
    routing: str = "uniform",
    seed: int = DEFAULT_SEED,
) -> Case:
    """Random inputs and weights of this rank (drawn on the device: a large model's weights are
    GBs); ``tokens`` per rank, else the shape's."""
    shape = resolve_shape(shape)
    config = shape.config(env.world_size)
    tokens = tokens or shape.tokens_per_rank
    seed = seed + _RANK_SEED_STRIDE * env.rank
    gen = torch.Generator(device=env.device).manual_seed(seed)
    kw: dict[str, Any] = dict(generator=gen, device=env.device)
    h, i, i_s = config.hidden_size, config.intermediate_size, config.shared_intermediate_size
    e_local = config.local_experts(env.world_size)

    def param(*shape: int) -> torch.Tensor:
        # Normal / sqrt(fan_in) keeps activations O(1) through the layer.
        w = torch.randn(shape, **kw).mul_(shape[-1] ** -0.5)
        return w.to(torch.bfloat16).requires_grad_(True)

    shared = (param(i_s, h), param(i_s, h), param(h, i_s)) if i_s else (None, None, None)
    weights = ExpertWeights(
        param(e_local, i, h), param(e_local, i, h), param(e_local, h, i), *shared
    )
    x = torch.randn((tokens, h), **kw).to(torch.bfloat16).requires_grad_(True)
    grad_y = torch.randn((tokens, h), **kw).to(torch.bfloat16)
    ids, w = make_routing(
        tokens,
        config.num_experts,
        config.top_k,
        kind=routing,
        world_size=env.world_size,
        generator=torch.Generator().manual_seed(seed),
        device=env.device,
    )
    return Case(shape, config, tokens, x, ids, w.requires_grad_(True), grad_y, weights)


def layer_fn(backend: str) -> Callable[..., torch.Tensor]:
    """The callable run for ``backend``, with the signature of ``moe_reference``.

    Value checks (which read device values, i.e. synchronize) are off: the inputs are known
    valid, and a training loop would turn them off too once debugged.
    """
    if backend == BASELINE:
        return torch_a2a_moe

    def run(x, topk_ids, topk_weights, weights, config, group):  # type: ignore[no-untyped-def]
        return functional.moe(
            x,
            topk_ids,
            topk_weights,
            weights,
            config,
            group=group,
            backend=backend,
            check_values=False,
        )

    return run


def layer_call(
    backend: str, case: Case, config: MoEConfig, group: dist.ProcessGroup | None, backward: bool
) -> Callable[[], None]:
    """One call of ``backend``'s layer on ``case``: the forward without grad, or with
    ``backward`` a training step (grads reset, forward, backward); for the tools that time or
    profile calls back to back."""
    fn = layer_fn(backend)

    def call() -> None:
        if backward:
            for t in case.leaves():
                t.grad = None
            fn(case.x, case.topk_ids, case.topk_weights, case.weights, config, group).backward(
                case.grad_y
            )
        else:
            with torch.no_grad():
                fn(case.x, case.topk_ids, case.topk_weights, case.weights, config, group)

    return call
