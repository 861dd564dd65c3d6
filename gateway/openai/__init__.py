"""The OpenAI wire format: request schemas, body parsing, prompt token ids and exact token counts."""
