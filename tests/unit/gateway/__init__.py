"""The gateway's parts without a server: config, queue, relay pieces, prefix index, auth, usage, the request's end."""
