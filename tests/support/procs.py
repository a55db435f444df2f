"""Processes for tests: gloo ranks spawned on the CPU, and the CLI as a user runs it (the
sm_90a compile subprocesses: ``support.background``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Seconds a CLI subprocess of a test may take.
CLI_TIMEOUT_S = 120


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(1234)  # same per rank; tests derive per-rank data explicitly
        fn(rank, world_size, *args)
        dist.barrier()  # every rank has passed its assertions
    except BaseException:
        dist.destroy_process_group()
        raise
    # Passed on every rank: leave without tearing gloo down. Its teardown aborted a rank now
    # and then (std::terminate inside gloo, in two of four full runs of the suite, on tests
    # whose every assertion had passed); the process ends here either way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(world_size: int, fn: Callable, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks."""
    fd, init_file = tempfile.mkstemp(prefix="megamoe-gloo-")
    os.close(fd)
    os.unlink(init_file)
    mp.spawn(_worker, args=(world_size, init_file, fn, args), nprocs=world_size, join=True)


def run_python(*args: str, timeout: int = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python <args>`` as a user runs it on a machine without a GPU (no interpreter: "auto"
    would time it)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
