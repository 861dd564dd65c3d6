"""A request context for unit tests of one stage: only the fields the stage reads, as a namespace, with the kinds a
RequestContext derives from its own kind (no Responses request here: each hop is sent the kind it came as)."""

from __future__ import annotations

from types import SimpleNamespace


class ContextStandIn(SimpleNamespace):
    @property
    def wire(self) -> str:
        return self.kind

    def hop_kind(self, _model: str) -> str:
        return self.kind
