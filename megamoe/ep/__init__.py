"""Expert-parallel infrastructure shared by the Triton backends.

``workspace``: the symmetric-memory buffers every rank reaches (and their one-process emulation);
``checks``: the per-workspace protocol state and the host checks that turn the device's error
records into exceptions without stalling the stream.
"""
