"""Paged attention and the KV-cache write behind one interface (backend.get_ops): torch reference, Triton, C++ CPU."""
