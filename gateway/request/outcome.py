"""How a request ended, as its event says it (status, reason, http_status, client_disconnected), decided once.

Many steps may learn how a request ends: admission (a refusal, a cancel, an internal error), dispatch (a timeout, an
upstream's refusal), the relay (a stream that timed out or broke), the stream's end (the client gone, a shutdown).
They all go through `Outcome.decide`, and the rule is: the first decisive outcome wins. Anything but "ok" is decisive;
a later decision is ignored, so a client that leaves a stream that already timed out or broke leaves it a timeout or
an error, and an error handler that sees a step's own decision (a timeout raised as a 504) keeps that step's words.
Only `disconnected` accumulates: it says the client left, whatever the outcome says.

A reason on a request that is still ok (`note_ok`: its output was cut at the reservation, "output_cut") is no
decision: a decisive outcome that comes after it (the client leaving) replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Outcome:
    status: str = "ok"  # ok | rejected | error | timeout | cancelled
    reason: str | None = None  # why it is not ok (or output_cut on an ok stream)
    http_status: int = 200  # what the client was, or would have been, answered
    disconnected: bool = False  # the client left before its answer was complete

    @property
    def decided(self) -> bool:
        """A decisive outcome was set: later ones are ignored."""
        return self.status != "ok"

    def decide(self, status: str, reason: str | None, http_status: int, *, disconnected: bool = False) -> bool:
        """Set the outcome unless one was decided before (then only `disconnected` is recorded). True if this call
        decided it."""
        assert status != "ok", "ok is where a request starts, not a decision"
        self.disconnected = self.disconnected or disconnected
        if self.decided:
            return False
        self.status, self.reason, self.http_status = status, reason, http_status
        return True

    def note_ok(self, reason: str) -> None:
        """A reason on a request that stays ok unless a decisive outcome comes later."""
        assert not self.decided, "a decided outcome keeps its own reason"
        self.reason = reason
