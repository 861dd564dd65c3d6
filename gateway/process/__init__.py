"""Processes: the command line, `serve` with its engine children and workers, the supervisor."""
