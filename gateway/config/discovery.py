"""Members found by DNS (`discovery:`, for the members marked `discover`)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from tokenweir.gateway.config.base import FOREVER_S, STRICT


@dataclass
class DiscoveryConfig:
    """How the members marked `discover` find their addresses: their host name resolved every `interval_s` (a
    Kubernetes headless Service's name gives one address per ready pod). A failed resolution, or an answer with no
    address, keeps the addresses known before (logged once): a DNS hiccup never empties a pool. Until its name first
    resolves, such a member is one instance at its name (the connection resolves it)."""

    interval_s: float = 5.0
    # DNS servers asked directly (dnspython), as IP:port or IP (port 53), [IPv6]:port; the name is queried as
    # written (fully qualified: no search domains). Empty: the system's resolver (getaddrinfo: /etc/hosts, and
    # resolv.conf's search domains, as a pod resolves `engine.<namespace>.svc.cluster.local`).
    nameservers: list[str] = field(default_factory=list)
    timeout_s: float = 2.0  # one resolution of one name
    drain_s: float = 30.0  # a vanished address drains this long (no new requests), then leaves the routing table

    __pydantic_config__ = STRICT

    def __post_init__(self) -> None:
        if not 0 < self.interval_s < FOREVER_S or not 0 < self.timeout_s < FOREVER_S:
            raise ValueError("discovery: interval_s and timeout_s are seconds > 0")
        if not 0 <= self.drain_s < FOREVER_S:
            raise ValueError("discovery: drain_s is seconds >= 0")
        for server in self.nameservers:
            nameserver_address(server)

    def nameserver_addresses(self) -> list[tuple[str, int]]:
        return [nameserver_address(s) for s in self.nameservers]


def nameserver_address(text: str) -> tuple[str, int]:
    """`IP`, `IP:port` or `[IPv6]:port` as (IP, port); a ValueError naming it otherwise."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest or "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        address, number = ipaddress.ip_address(host), int(port)
    except ValueError:
        address, number = None, 0
    if address is None or not 0 < number < 65536:
        raise ValueError(f"discovery.nameservers: expected IP, IP:port or [IPv6]:port, got {text!r}")
    return str(address), number
