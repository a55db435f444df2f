"""Every kernel variant the backends launch, compiled for sm_90a once per session.

``megamoe.tools.compile_check`` runs the backends' host code on meta tensors, records each
launch and compiles it (subprocess with the interpreter off: ``@triton.jit`` functions defined
under ``TRITON_INTERPRET=1`` cannot be compiled). No GPU is needed: Triton ships ptxas.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from support.procs import run_without_interpreter  # noqa: E402


@pytest.fixture(scope="session")
def compiled() -> list[dict]:
    """One report per compiled launch (``compile_check.compile_launch``, with its PTX)."""
    out = run_without_interpreter(
        ["-m", "megamoe.tools.compile_check", "--json", "--ptx"], timeout=1200
    )
    return json.loads(out.strip().splitlines()[-1])
