"""The engine server as a process: its CLI, metrics, logs and door limits."""
