"""The engine's OpenAI server in this process: real HTTP, streams, disconnects, aborts, its API key."""
