"""One behaviour on both state backends: in memory and on the real Redis."""
