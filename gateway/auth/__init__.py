"""Who is calling: API keys (hashed) and the principal a request runs as."""
