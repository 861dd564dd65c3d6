"""Noticing that a client went away while its request runs: the watch the gateway uses too
(gateway/request/disconnect.py)."""

from __future__ import annotations

from tokenweir.gateway.request.disconnect import wait_disconnect as wait_for_disconnect

__all__ = ["wait_for_disconnect"]
