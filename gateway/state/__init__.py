"""Live limits state: in memory or in Redis (scripts, key layout, repair after a loss), and the outbox."""
