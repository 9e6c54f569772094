"""Kernel sources: per-item helpers built once per target (``backend.device_jit``)."""
