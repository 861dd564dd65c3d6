"""The batch jobs' section (`batches:`): /v1/files uploads and the /v1/batches runner (gateway/batches/)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenweir.gateway.config.base import STRICT


@dataclass
class BatchesConfig:
    """OpenAI batch jobs: how big an uploaded file may be, and how each replica's runner paces a batch's lines."""

    # An uploaded file's largest size (the whole multipart body): over it, 413 file_too_large. Files are kept in the
    # store, so this bounds one row too.
    max_file_bytes: int = 64 * 1024 * 1024
    max_lines: int = 50_000  # lines one input file may hold (OpenAI's bound)
    # Lines of one batch in flight at once on this replica. A line also waits while interactive (non-batch band)
    # requests wait in its pool's dispatch queue, so batches fill only the capacity interactive traffic leaves.
    concurrency: int = 4
    # Dispatch slots of a pool that batch lines leave free for interactive arrivals: a line starts only while its
    # pool has more free slots than this, so a new interactive request finds one instead of waiting for a batch line
    # to end (its TTFT). 0: a line may take any free slot. Applies to lines naming a pool (not an alias).
    interactive_headroom: int = 0
    # Lines of one batch in flight at once on this replica while interactive requests are in flight in the line's
    # pool: the engines run batch lines beside interactive ones in the same steps, so each line there slows every
    # interactive request's first token; fewer lines keep it (a batch then runs at full `concurrency` in the gaps)
    concurrency_beside_interactive: int = 1
    # How long a batch's completion_window ("24h", the only one OpenAI accepts) lasts, in seconds: what is not done
    # by then is failed as batch_expired. Lower it to give batches a tighter deadline (or in tests).
    completion_window_s: float = 24 * 3600.0
    # A replica running a batch holds a lease on it in the store, renewed every lease_s / 3; a replica that died
    # loses it lease_s later and another replica (or its restart) resumes the batch where it stopped.
    lease_s: float = 30.0
    poll_interval_s: float = 1.0  # how often each replica looks for batches to run (a new batch starts at once)

    __pydantic_config__ = STRICT

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_lines", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"batches.{name}: at least 1, got {getattr(self, name)!r}")
        if self.concurrency_beside_interactive < 1 or self.concurrency_beside_interactive > self.concurrency:
            raise ValueError(
                f"batches.concurrency_beside_interactive: 1 to concurrency, got {self.concurrency_beside_interactive!r}"
            )
        if self.interactive_headroom < 0:
            raise ValueError(f"batches.interactive_headroom: at least 0, got {self.interactive_headroom!r}")
        for name in ("completion_window_s", "lease_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"batches.{name}: seconds > 0, got {getattr(self, name)!r}")
