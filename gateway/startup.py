"""What the gateway does at start-up before it serves (its lifespan, gateway/app.py, calls these): replay the events
whose usage a crash kept out of the store, and seed the limits state's budgets from the store, retrying (admission
answers 503 state_unavailable meanwhile) while a shared state is unreachable, then watching it for a loss.
"""

from __future__ import annotations

import asyncio
import time

from tokenweir.common.logging import get_logger
from tokenweir.gateway.accounting.events import EventWriter, replay_after
from tokenweir.gateway.accounting.usage import UsageRecorder, seed_key_budgets
from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.request.admission import Admission
from tokenweir.gateway.state.backend import StateBackend, StateUnavailable
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.state.redis_connection import REDIS_ERRORS
from tokenweir.gateway.state.repair import StateWatch
from tokenweir.gateway.store.store import Store
from tokenweir.policies.budget import DAY, MONTH, day_key, period_start_day
from tokenweir.policies.pricing import usd_to_femtos

log = get_logger()


async def seed_state(
    store: Store, state: StateBackend, admission: Admission, usage: UsageRecorder, config: GatewayConfig
) -> asyncio.Task[None] | None:
    """The limits state's budgets from the store: this process's own states now; a shared one by a task that retries
    until it answers (admission waits for it) and then watches it, returned so that shutdown can stop it."""
    if admission.local is not None:
        await seed_budgets(store, admission.local)
    if isinstance(state, InMemoryState):
        await seed_budgets(store, state)
        return None
    admission.state_ready = False
    watch = StateWatch(state, store, usage, watch_s=config.state.watch_s) if isinstance(state, RedisState) else None
    return asyncio.create_task(seed_until_ready(store, state, admission, watch))


async def seed_until_ready(
    store: Store, state: StateBackend, admission: Admission, watch: StateWatch | None = None
) -> None:
    """Seed the shared state's budgets, retrying while it is unreachable; admission waits for it (503 meanwhile).
    With a `watch` (Redis), it then watches the state's epoch and rebuilds it after a loss (gateway.state.repair)."""
    delay = 0.25
    while True:
        try:
            if watch is None:
                await seed_budgets(store, state)
            else:
                await watch.start()
            admission.state_ready = True
            log.info("state_ready")
            if watch is not None:
                await watch.run()
            return
        except (StateUnavailable, *REDIS_ERRORS) as e:
            log.warning("state_unreachable_at_start", error=f"{type(e).__name__}: {e}", retry_in_s=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def seed_budgets(store: Store, state) -> None:
    """Spend already recorded this UTC day / month, so a restart does not hand out fresh budgets."""
    now = time.time()
    day, month = period_start_day(DAY, now), period_start_day(MONTH, now)

    def read() -> list[tuple[str, int, int]]:
        return [(t.id, store.spent_tokens(t.id, day), store.spent_tokens(t.id, month)) for t in store.list_teams()]

    for team_id, day_tokens, month_tokens in await asyncio.to_thread(read):
        if day_tokens or month_tokens:
            await state.seed_spend(team_id, day_tokens, month_tokens)
    await seed_key_budgets(store, state)  # the keys' own budgets, and every spend (USD) budget


async def replay_usage(store: Store, usage: UsageRecorder, events: EventWriter, config: GatewayConfig) -> set[str]:
    """Usage of the events written after the store's watermark for this writer (a crash came between the event
    and the usage flush): added and flushed before anything is served or any budget is seeded. Returns their
    upstream request ids (billed already: the in-flight recovery skips them)."""
    assert usage.writer is not None  # the watermark is kept per writer: the lifespan names this one
    watermark = await asyncio.to_thread(store.usage_watermark, usage.writer)
    # Requests billed straight to the store (their event or journal line could not be written): never again here
    settled = await asyncio.to_thread(store.settled_requests, usage.writer)
    path, backups = config.events.path, config.events.backups
    replayed, billed = 0, set(settled)
    for e in await asyncio.to_thread(lambda: list(replay_after(path, watermark, backups))):
        usage.seq = max(usage.seq, e["seq"])  # the watermark passes events without usage too
        if e.get("upstream_request_id"):
            billed.add(e["upstream_request_id"])
        if e.get("route") and e.get("team") and e.get("upstream_request_id") not in settled:
            model = e.get("served_model") or e.get("model")
            assert model is not None  # a served request's event names its model
            prompt, completion = e.get("prompt_tokens") or 0, e.get("completion_tokens") or 0
            day = day_key(e["ts"])
            usage.add(
                e["team"],
                model,
                prompt,
                completion,
                e.get("cached_tokens") or 0,
                day=day,
                seq=e["seq"],
                key_id=e.get("key_id"),
                user=e.get("user"),
                cost_femtos=usd_to_femtos(e.get("cost") or 0),
            )
            replayed += 1
    events.open(after_seq=watermark)  # seqs go on past both the file's and the store's last
    if replayed:
        await usage.flush()
        log.warning("usage_replayed", events=replayed, after_seq=watermark, writer=usage.writer)
    return billed
