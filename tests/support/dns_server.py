"""A DNS server on loopback for discovery tests: UDP on 127.0.0.1, a free port, answering A and AAAA queries from a
dict the test changes while it runs (a Kubernetes headless Service whose pods come and go)."""

from __future__ import annotations

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import DNSLogger, DNSServer


class LoopbackDNS:
    """`records[name]` (no trailing dot) -> its addresses; an unknown name is NXDOMAIN. Use as a context manager."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.queries = 0

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        """dnslib's resolver interface: called on the server's thread for each query."""
        self.queries += 1
        reply = request.reply()
        qname, qtype = request.q.qname, QTYPE[request.q.qtype]
        addresses = self.records.get(str(qname).rstrip(".").lower())
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for address in addresses:
            v6 = ":" in address
            if qtype == ("AAAA" if v6 else "A"):
                rdata = AAAA(address) if v6 else A(address)
                reply.add_answer(RR(qname, QTYPE.AAAA if v6 else QTYPE.A, rdata=rdata, ttl=0))
        return reply

    def __enter__(self) -> LoopbackDNS:
        self.server = DNSServer(self, address="127.0.0.1", port=0, logger=DNSLogger(logf=lambda _: None))
        self.port = self.server.server.server_address[1]
        self.server.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.server.server.server_close()

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"
