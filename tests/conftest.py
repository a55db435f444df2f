"""Test setup: the Triton interpreter must be switched on before any kernel is defined."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
