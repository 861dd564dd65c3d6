"""The attention backend choice and the kernel benchmark's smoke run."""
