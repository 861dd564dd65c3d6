"""In-process app tests: the gateway's or the engine's ASGI app in this process, over real HTTP or ASGI, against a
fake upstream or an engine in this process."""
