"""What the gateway and the engine both use, so that neither imports the other: the HTTP contracts (errors, the
door's limits, the disconnect watch, the request-id rule), the text contracts (tokenizer, chat template, prefix
hashes), the engine flags `serve` writes, and one JSON logging set-up. Torch-free; imports nothing of tokenweir
outside itself."""
