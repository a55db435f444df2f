"""Subprocesses of the compile tests run in the background while the other tests run.

Compiling every kernel for sm_90a takes minutes of one core; the interpreter tests take one core
too. A job is defined once (a name, ``python`` arguments, a timeout), started when collection
ends (``tests/compile/conftest.py``: only the jobs a selected test needs) and run one at a time,
in the order defined, on one worker thread (the later jobs find the earlier ones' kernels in
Triton's cache); the tests that need its output ask :func:`stdout`, which waits for it (and
starts it first if nothing did). ``tests/conftest.py`` runs the compile tests last.

Under pytest-xdist (``-n 2``) the workers share each job through files in one directory
(:func:`share`): whichever worker runs a job first holds its lock and writes its result, and a
worker that needs it later waits on the lock and reads the result, so every job runs once per
session whichever worker its tests land on.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

__all__ = ["define", "share", "start", "stdout", "stop_all", "JOBS"]


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
_shared_dir: str | None = None  # where the workers of one xdist session share results


def share(directory: str) -> None:
    """Share every job's result with the other processes that name the same ``directory``."""
    global _shared_dir
    os.makedirs(directory, exist_ok=True)
    _shared_dir = directory


def define(name: str, args: list[str], timeout: float) -> None:
    """Define the job ``name``: ``python <args>`` with TRITON_INTERPRET=0 (the interpreter
    replaces ``triton.jit``, so kernels defined under it cannot be compiled for sm_90a)."""
    with _lock:
        JOBS.setdefault(name, Job(list(args), timeout))


def _run(name: str) -> None:
    """Run job ``name`` (with a shared directory: unless another process wrote its result)."""
    job = JOBS[name]
    try:
        if _shared_dir is None:
            job.result = _run_process(job)
        else:
            job.result = _run_shared(job, os.path.join(_shared_dir, name))
    finally:
        job.done.set()


def _run_shared(job: Job, path: str) -> tuple[int, str, str]:
    try:
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (held while another process runs it)
            if os.path.exists(path + ".json"):
                with open(path + ".json") as f:
                    return tuple(json.load(f))
            result = _run_process(job)
            with open(path + ".json.tmp", "w") as f:
                json.dump(result, f)
            os.replace(path + ".json.tmp", path + ".json")
            return result
    except OSError as e:
        return (-1, "", f"could not share its result in {path}: {e!r}")


def _run_process(job: Job) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of the job's subprocess."""
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
            return (job.proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            out, err = job.proc.communicate()
            return (-1, out, f"timed out after {job.timeout} s\n{err}")
    except BaseException as e:  # noqa: BLE001 (reported by the test that needs it)
        return (-1, "", f"could not run: {e!r}")


def _work() -> None:
    while True:
        with _wake:
            while not _queue and not _stopped:
                _wake.wait()
            if _stopped:
                return
            name = _queue.pop(0)
        _run(name)


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
    """End the worker and any job still running (a session that ends early). A shared job
    still running is waited for instead: another worker may be waiting for its result (the
    queued ones are left to whichever worker needs them)."""
    global _stopped
    with _wake:
        _stopped = True
        _queue.clear()
        _wake.notify()
    for job in JOBS.values():
        if job.proc is not None and job.proc.poll() is None:
            if _shared_dir is None:
                job.proc.kill()
            job.done.wait(timeout=job.timeout)  # (its result written, its lock released)
