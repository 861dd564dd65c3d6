"""Where requests go: pools, instances, breakers, the prefix index, the upstream HTTP client (aiohttp)."""
