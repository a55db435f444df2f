"""Subprocesses of the compile tests run in the background while the other tests run.

Compiling every kernel for sm_90a takes minutes of one core; the interpreter tests take one core
too. A job is defined once (a name, ``python`` arguments, a timeout), started when collection
ends (``tests/compile/conftest.py``: only the jobs a selected test needs) and run one at a time,
in the order defined, on one worker thread (the later jobs find the earlier ones' kernels in
Triton's cache); the tests that need its output ask :func:`stdout`, which waits for it (and
starts it first if nothing did). ``tests/conftest.py`` runs the compile tests last.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

__all__ = ["define", "start", "stdout", "stop_all", "JOBS"]


@dataclass
class Job:
    args: list[str]
    timeout: float
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[int, str, str] | None = None  # (returncode, stdout, stderr)
    proc: subprocess.Popen | None = None


JOBS: dict[str, Job] = {}
_lock = threading.Lock()
_queue: list[str] = []
_wake = threading.Condition(_lock)
_worker: threading.Thread | None = None
_stopped = False


def define(name: str, args: list[str], timeout: float) -> None:
    """Define the job ``name``: ``python <args>`` with TRITON_INTERPRET=0 (the interpreter
    replaces ``triton.jit``, so kernels defined under it cannot be compiled for sm_90a)."""
    with _lock:
        JOBS.setdefault(name, Job(list(args), timeout))


def _run(job: Job) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    try:
        job.proc = subprocess.Popen(
            [sys.executable, *job.args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = job.proc.communicate(timeout=job.timeout)
            job.result = (job.proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            out, err = job.proc.communicate()
            job.result = (-1, out, f"timed out after {job.timeout} s\n{err}")
    except BaseException as e:  # noqa: BLE001 (reported by the test that needs it)
        job.result = (-1, "", f"could not run: {e!r}")
    finally:
        job.done.set()


def _work() -> None:
    while True:
        with _wake:
            while not _queue and not _stopped:
                _wake.wait()
            if _stopped:
                return
            name = _queue.pop(0)
        _run(JOBS[name])


def start(names: list[str]) -> None:
    """Queue the jobs ``names`` (those not queued yet) on the worker thread."""
    global _worker
    with _wake:
        for name in names:
            job = JOBS[name]
            if not job.started:
                job.started = True
                _queue.append(name)
        if _worker is None:
            _worker = threading.Thread(target=_work, name="compile-jobs", daemon=True)
            _worker.start()
        _wake.notify()


def stdout(name: str) -> str:
    """The job's stdout once it has ended (it must exit 0)."""
    job = JOBS[name]
    start([name])
    # (the job's own timeout ends it; this bound only guards against a stuck worker)
    if not job.done.wait(timeout=job.timeout + sum(j.timeout for j in JOBS.values())):
        raise TimeoutError(f"background job {name!r} never ended")
    code, out, err = job.result
    assert code == 0, f"{name}: exit {code}\n{err[-4000:]}"
    return out


def stop_all() -> None:
    """End the worker and any job still running (a session that ends early)."""
    global _stopped
    with _wake:
        _stopped = True
        _queue.clear()
        _wake.notify()
    for job in JOBS.values():
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
