"""The step loop and its records: sequences, scheduling over the paged KV pool, running and sampling a batch, stats."""
