"""The HTTP face: the ASGI app and its lifespan, middleware, thin routes, probes, the door's limits."""
