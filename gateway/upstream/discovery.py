"""Pool members found by DNS (`discover: true`: a Kubernetes headless Service's name, one address per ready pod).

Two parts. `expand` is pure: each discovered member of the composed pool configs becomes one member per address,
`<name>-<address>` at base_url with the address for the host; routing_sync.py applies it right before a table is
swapped in, and again to its last composed table when the addresses change. `Discovery` keeps the addresses between
resolutions: one that appears joins (and takes requests once its /load or /health answers: pools.py starts a
discovered instance down); one that vanishes drains (no new requests; those it serves finish on the table they
started with) for `drain_s`, then leaves. A failed resolution, or one with no address, keeps what was known.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import dns.exception

from tokenweir.common.logging import get_logger
from tokenweir.gateway.config import DiscoveryConfig, PoolConfig

log = get_logger()
Resolve = Callable[[str], Awaitable[list[str]]]  # a host name -> its addresses; raises on failure


@dataclass(frozen=True, slots=True)
class Addresses:
    """What a discovered name stands for: the addresses it resolves to, and those that vanished and still drain."""

    live: tuple[str, ...]
    leaving: tuple[str, ...] = ()


def host_of(base_url: str) -> str:
    return urlsplit(base_url).hostname or ""


def at_address(base_url: str, address: str) -> str:
    """`base_url` with `address` for its host (an IPv6 one in brackets), its scheme, port and path kept."""
    parts = urlsplit(base_url)
    host = f"[{address}]" if ":" in address else address
    return parts._replace(netloc=host if parts.port is None else f"{host}:{parts.port}").geturl()


def expand(pools: list[PoolConfig], found: Mapping[str, Addresses]) -> list[PoolConfig]:
    """`pools` with each discovered member whose name `found` knows replaced by one member per address, the leaving
    ones draining. Pure and ordered: equal inputs make equal pools, so `Upstreams.apply` keeps every instance that
    did not change. A member whose name has not resolved yet stays as written; an address whose member name another
    member of the pool already has is left out."""
    out = []
    for pool in pools:
        if not any(u.discover and host_of(u.base_url) in found for u in pool.upstreams):
            out.append(pool)
            continue
        taken = {u.name for u in pool.upstreams}
        members = []
        for u in pool.upstreams:
            addresses = found.get(host_of(u.base_url)) if u.discover else None
            if addresses is None:
                members.append(u)
                continue
            for address in sorted({*addresses.live, *addresses.leaving}, key=_order):
                name = f"{u.name}-{address}"
                if name in taken:
                    continue
                taken.add(name)
                draining = u.draining or address not in addresses.live
                members.append(replace(u, name=name, base_url=at_address(u.base_url, address), draining=draining))
        out.append(replace(pool, upstreams=members))
    return out


def _order(address: str) -> tuple[int, int]:
    ip = ipaddress.ip_address(address)
    return ip.version, int(ip)


def system_resolver() -> Resolve:
    """The system's resolver (getaddrinfo on the event loop's threads: /etc/hosts, resolv.conf's search domains)."""

    async def resolve(name: str) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
        return [str(info[4][0]) for info in infos]

    return resolve


def dns_resolver(servers: list[tuple[str, int]], timeout_s: float) -> Resolve:
    """A and AAAA records of the name (fully qualified) from these DNS servers (IP, port), asked directly."""
    import dns.asyncresolver
    import dns.nameserver
    import dns.resolver

    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in servers]
    resolver.lifetime = timeout_s

    async def records(name: str, rdtype: str) -> list[str]:
        try:
            answer = await resolver.resolve(name, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        return [rdata.address for rdata in answer]

    async def resolve(name: str) -> list[str]:
        absolute = name if name.endswith(".") else name + "."
        v4, v6 = await asyncio.gather(records(absolute, "A"), records(absolute, "AAAA"))
        return v4 + v6

    return resolve


class Discovery:
    """The discovered names' addresses, kept between resolutions (`refresh`), and `expand` over them."""

    def __init__(
        self, config: DiscoveryConfig, resolve: Resolve | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config, self.clock = config, clock
        servers = config.nameserver_addresses()
        self.resolve = resolve or (dns_resolver(servers, config.timeout_s) if servers else system_resolver())
        self.found: dict[str, Addresses] = {}
        self._vanished: dict[str, dict[str, float]] = {}  # name -> address -> when it vanished (monotonic)
        self._failing: set[str] = set()  # names whose last resolution failed (logged once until one succeeds)

    def expand(self, pools: list[PoolConfig]) -> list[PoolConfig]:
        return expand(pools, self.found)

    async def refresh(self, pools: list[PoolConfig]) -> bool:
        """Resolve the names of `pools`' discovered members again; True if what `expand` makes changed (an address
        came or went, or a vanished one's drain time passed)."""
        names = sorted({host_of(u.base_url) for p in pools for u in p.upstreams if u.discover})
        answers = await asyncio.gather(*(self._lookup(n) for n in names))
        now, before = self.clock(), self.found
        found = {}
        for name, answer in zip(names, answers, strict=True):
            if answer is not None or name in before:
                found[name] = self._update(name, answer, now)
        self._vanished = {n: v for n, v in self._vanished.items() if n in found}
        self.found = found
        return found != before

    async def _lookup(self, name: str) -> tuple[str, ...] | None:
        """The name's addresses, None when it failed or had none (said in the log once until it answers again)."""
        error = "no address"
        try:
            async with asyncio.timeout(self.config.timeout_s):
                raw = await self.resolve(name)
            addresses = {str(ipaddress.ip_address(a)) for a in raw if "%" not in a}  # no link-local scope ids
        except (OSError, TimeoutError, ValueError, dns.exception.DNSException) as exc:
            addresses, error = set(), f"{type(exc).__name__}: {exc}"
        if not addresses:
            if name not in self._failing:
                self._failing.add(name)
                known = self.found.get(name)
                log.warning("discovery_failed", name=name, error=error, kept=list(known.live) if known else [])
            return None
        if name in self._failing:
            self._failing.discard(name)
            log.info("discovery_recovered", name=name)
        return tuple(sorted(addresses, key=_order))

    def _update(self, name: str, answer: tuple[str, ...] | None, now: float) -> Addresses:
        prev = self.found.get(name)
        live = prev.live if prev is not None else ()
        vanished = self._vanished.setdefault(name, {})
        if answer is not None and answer != live:
            gone = [a for a in live if a not in answer]
            for address in gone:
                vanished[address] = now
            for address in answer:
                vanished.pop(address, None)
            added = [a for a in answer if a not in live]
            log.info("discovery_changed", name=name, addresses=list(answer), added=added, removed=gone)
            live = answer
        for address, since in list(vanished.items()):
            if now - since >= self.config.drain_s:
                del vanished[address]
        return Addresses(live, tuple(sorted(vanished, key=_order)))
