"""The C++ CPU kernels: their sources, the cached per-machine build, and the Python wrappers that load and call them."""
