"""Shared test helpers: random problems, an independent float64 oracle, gloo process spawning."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamoe import ExpertWeights, MoEConfig
from megamoe.routing import make_routing
from megamoe.testing import rel_err  # noqa: F401  (re-exported for the tests)


def random_routing(t: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token, softmax weights (megamoe.routing, uniform)."""
    return make_routing(t, e, k, generator=gen)


def random_weights(cfg: MoEConfig, e_local: int, gen: torch.Generator,
                   dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
    h, i, i_s = cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)

    shared = (w(i_s, h), w(i_s, h), w(h, i_s)) if i_s else (None, None, None)
    return ExpertWeights(w(e_local, i, h), w(e_local, i, h), w(e_local, h, i), *shared)


def loop_oracle(x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor,
                weights: ExpertWeights) -> torch.Tensor:
    """The layer's definition token by token, in float64; independent of megamoe.reference."""
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    wg, wu, wd, sg, su, sd = (f64(t) for t in weights)
    xd = x.double()
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g, u = wg[e] @ xd[t], wu[e] @ xd[t]
            acc = acc + tw[t, k].double() * (wd[e] @ (g * torch.sigmoid(g) * u))
        if sg is not None:
            g, u = sg @ xd[t], su @ xd[t]
            acc = acc + sd @ (g * torch.sigmoid(g) * u)
        out.append(acc)
    return torch.stack(out)


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        torch.manual_seed(1234)  # same per rank; tests derive per-rank data explicitly
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(world_size: int, fn: Callable, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks."""
    fd, init_file = tempfile.mkstemp(prefix="megamoe-gloo-")
    os.close(fd)
    os.unlink(init_file)
    mp.spawn(_worker, args=(world_size, init_file, fn, args), nprocs=world_size, join=True)


def run_without_interpreter(args: list[str], timeout: int = 300) -> str:
    """Run ``python <args>`` with TRITON_INTERPRET=0 (the interpreter replaces ``triton.jit``,
    so kernels defined under it cannot be compiled for sm_90a); return its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout
