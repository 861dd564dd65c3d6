"""Disaggregated prefill: a producer engine computes a prompt and keeps its KV blocks pinned (pins.py), serves them
over TCP (server.py) in a checked layout (layout.py); a consumer engine fetches them into its own blocks (fetcher.py)
from producers it trusts only (trust.py: answers signed with the engines' key, or listed addresses) and decodes. A
request's `kv_transfer_params` (params.py) say which hop it is. The engine drives them through a
KVTransferCoordinator (coordinator.py), the scheduler's side of the transfer."""
