"""tokenweir engine: paged-KV, continuous-batching inference for Llama-family models."""
