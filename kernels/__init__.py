"""The kernels the engine calls: attention/ (paged attention + KV write backends) and cpu/ (the C++ CPU kernels)."""
