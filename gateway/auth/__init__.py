"""Who is calling: an API key looked up (through a short cache) as the principal a request runs as."""
