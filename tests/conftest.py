"""Test set-up: the Triton interpreter must be switched on before any kernel is defined, and
``tests/`` is on the path so that every test directory imports ``support``.

  unit/     pure Python and PyTorch (gloo ranks on the CPU)
  interp/   the Triton kernels under the interpreter (TRITON_INTERPRET=1)
  compile/  every kernel compiled for sm_90a on the CPU (subprocess without the interpreter)
  integrations/  the transformers and torchtitan adapters (tiny models on the CPU)
  gpu/      on an H200 (scripts/gpu_check.sh; CI has no GPU)
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
