"""The interpreter tests run only with TRITON_INTERPRET=1 (GPU runs are in tests/gpu)."""

import pytest

pytest.importorskip("triton")

from megamoe.kernels.runtime import interpreting  # noqa: E402

collect_ignore_glob = [] if interpreting() else ["test_*.py"]
