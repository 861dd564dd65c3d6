"""Runtime pools and aliases: the routing table kept in step with the store (routing_sync) and the rollouts judged on
it (rollouts). Above upstream/ and store/, so the upstream room never imports the store."""
