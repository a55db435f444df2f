"""Reading the sm_90a compile reports of ``megamoe.tools.compile_check``."""

from __future__ import annotations

__all__ = ["SMEM_LIMIT", "SM_SHARED", "REGISTERS_PER_SM", "MAX_REGISTERS_PER_THREAD", "pick"]

SMEM_LIMIT = 227 * 1024  # bytes of shared memory one H100/H200 block may use
SM_SHARED = 228 * 1024  # bytes of one SM's shared memory, its blocks' (each + 1 KB) together
REGISTERS_PER_SM = 64 * 1024
MAX_REGISTERS_PER_THREAD = 255


def pick(compiled: list[dict], name: str, scenario: str | None = None) -> list[dict]:
    """The reports of kernel ``name`` (from scenarios whose label contains ``scenario``)."""
    found = [
        r for r in compiled if r["name"] == name and (scenario is None or scenario in r["scenario"])
    ]
    assert found, f"{name} ({scenario}) was not launched: {sorted({r['name'] for r in compiled})}"
    return found
