"""Every kernel variant the backends launch, compiled for sm_90a once per session.

``megamoe.tools.compile_check`` runs the backends' host code on meta tensors, records each
launch and compiles it (subprocess with the interpreter off: ``@triton.jit`` functions defined
under ``TRITON_INTERPRET=1`` cannot be compiled). No GPU is needed: Triton ships ptxas.

The compiles run in the background (``support.background``) from the end of collection on,
while the other tests run; ``tests/conftest.py`` runs these tests last.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from support import background  # noqa: E402

background.define(
    "compiled", ["-m", "megamoe.tools.compile_check", "--json", "--ptx"], timeout=1200
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the compile jobs that the selected tests need (their fixtures' names). Under
    pytest-xdist the workers share the jobs' results and only the first worker starts them
    now (the others wait for its results if their tests need them)."""
    if session.config.option.collectonly:
        return
    worker = getattr(session.config, "workerinput", None)
    if worker is not None:
        # (the session's base temporary directory, shared by its workers and cleaned up by
        # pytest as every tmp_path is: the recipe pytest-xdist documents)
        shared = session.config._tmp_path_factory.getbasetemp().parent / "compile-jobs"
        background.share(str(shared))
        if worker["workerid"] != "gw0":
            return
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    background.start([name for name in background.JOBS if name in needed])


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()


@pytest.fixture(scope="session")
def compiled() -> list[dict]:
    """One report per compiled launch (``compile_check.compile_launch``, with its PTX)."""
    out = background.stdout("compiled")
    return json.loads(out.strip().splitlines()[-1])
