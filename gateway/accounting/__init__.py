"""What was served: the JSONL event log, usage rows, Prometheus metrics."""
