"""The engine against HF transformers (tokens, tokenizer, quality) and the gateway's prefix hashes."""
