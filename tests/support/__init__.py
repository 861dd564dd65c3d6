"""Test support: servers in threads and processes, the fault harness, fixtures shared by the groups."""
