"""Where requests go: pools, instances, breakers, the prefix index, the HTTP/1.1 client."""
