"""The engine's parts in this process: scheduler, blocks, sampling, choices, grammar, precision."""
