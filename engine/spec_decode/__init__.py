"""Speculative decoding: proposers of draft tokens (the target model verifies them in the model runner), and the
Speculator that runs them for the engine's step (speculator.py)."""
