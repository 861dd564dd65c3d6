"""Building the CPU kernels in processes that start, die and race."""
