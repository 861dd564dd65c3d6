"""Real-process tests: `tokenweir serve`, engine children, workers, the supervisor, faults injected into running
processes, the packaged wheel and the lab."""
