"""Paged-attention and KV-cache kernels: Triton on CUDA, torch reference elsewhere."""
