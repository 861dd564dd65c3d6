"""HTTP contracts both servers keep: OpenAI-shaped errors, the connection limits at the door, the disconnect watch,
the request-id rule."""
