"""Test support shared by the CPU, interpreter, compile and GPU tests (``tests/conftest.py`` puts
``tests/`` on the path): problems and cases, the float64 oracle, bitwise comparisons, the
lockstep driver of emulated ranks, process helpers."""
