"""Test set-up: the Triton interpreter must be switched on before any kernel is defined, and
``tests/`` is on the path so that every test directory imports ``support``.

  unit/     pure Python and PyTorch (gloo ranks on the CPU)
  interp/   the Triton kernels under the interpreter (TRITON_INTERPRET=1)
  compile/  every kernel compiled for sm_90a on the CPU (subprocess without the interpreter)
  integrations/  the transformers and torchtitan adapters (tiny models on the CPU)
  gpu/      on an H200 (scripts/gpu_check.sh; CI has no GPU)

The compile/ tests run last: their compiles run in the background meanwhile
(``support.background``), on the core the interpreter leaves free.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_COMPILE = Path(__file__).resolve().parent / "compile"


def pytest_collection_modifyitems(items: list) -> None:
    """Every other test first, in its order; then the compile tests, in theirs."""
    items.sort(key=lambda item: Path(item.path).resolve().is_relative_to(_COMPILE))
