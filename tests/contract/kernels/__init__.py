"""Triton and CPU kernels against torch references (Triton interpreted on CPU)."""
