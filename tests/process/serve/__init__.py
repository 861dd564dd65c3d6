"""`tokenweir serve` as processes: one, --workers N, --engines N, signals, config errors, the door."""
