"""The gateway app in this process against fake upstreams: admission, limits, billing, routing, relay, admin."""
