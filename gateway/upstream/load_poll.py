"""The load poll of one instance (gateway/upstream/pools.py `Upstreams` runs it for every engine, each poll
interval, and for discovered members until they first answer): what an engine's GET /load tells the router.

Its load ranks it (least loaded first); what it reports evicted leaves its pool's prefix index; its model digest is
the revision it serves; an answer sent after it went down brings it back up. Its context length is asked once, of
its /v1/models. A poll that fails only leaves the load unknown: failures count toward the circuit on real requests.
"""

from __future__ import annotations

import time

from tokenweir.common.logging import get_logger
from tokenweir.gateway.upstream.client import UpstreamClient, request_json, request_ok
from tokenweir.gateway.upstream.instance import Instance


async def poll_instance(client: UpstreamClient, inst: Instance) -> None:
    """One poll of `inst`: an engine's /load (its load, what it evicted, its model version; back up if it was
    down), or a discovered external member's /health until it first answers."""
    sent = time.monotonic()
    if not inst.cfg.engine:  # a discovered external member: up once its /health answers 2xx
        healthy = await request_ok(client, f"{inst.cfg.base_url}/health", headers=inst.auth_headers())
        if healthy and awaiting_first_answer(inst):
            inst.mark_up()
            get_logger().info("upstream_up", model=inst.model, upstream=inst.name)
        return
    query = ""
    if inst.evicted_seq is not None and inst.evicted_epoch is not None:
        query = f"?since={inst.evicted_seq}&epoch={inst.evicted_epoch}"
    # None (unknown load) falls back to in-flight; failures count only on real requests
    inst.load = await request_json(client, "GET", f"{inst.cfg.base_url}/load{query}", headers=inst.auth_headers())
    if isinstance(inst.load, dict):
        if inst.down_since is not None and sent > inst.down_since:  # answered after it went down: back up
            inst.mark_up()
            get_logger().info("upstream_up", model=inst.model, upstream=inst.name)
        forget_evicted(inst, inst.load)
        if isinstance(revision := inst.load.get("model_revision"), str):
            inst.learn_revision(revision[:64])
        if inst.max_model_len is None:
            inst.max_model_len = await _model_len(client, inst)


def awaiting_first_answer(inst: Instance) -> bool:
    """A discovered member that has not answered a poll since it joined."""
    return inst.cfg.discover and inst.down_since is not None


async def _model_len(client: UpstreamClient, inst: Instance) -> int | None:
    """The engine's context length, as its /v1/models reports it (`max_model_len` of its first model)."""
    models = await request_json(client, "GET", f"{inst.cfg.base_url}/v1/models", headers=inst.auth_headers())
    data = models.get("data") if isinstance(models, dict) else None
    value = data[0].get("max_model_len") if isinstance(data, list) and data and isinstance(data[0], dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def forget_evicted(inst: Instance, load: dict) -> None:
    """What a /load answer says the engine evicted leaves the pool's prefix index. Another eviction log (the engine
    restarted: its cache is empty) or a gap in this one (we fell behind) forgets all the index says it holds."""
    if inst.index is None or "evicted_seq" not in load:
        return
    epoch, seq = load.get("evicted_epoch"), load.get("evicted_seq")
    if inst.evicted_epoch is not None and (epoch != inst.evicted_epoch or not load.get("evicted_complete", True)):
        inst.index.forget_instance(inst.name)
    else:
        inst.index.forget(inst.name, load.get("evicted_hashes") or ())
    inst.evicted_epoch, inst.evicted_seq = epoch, seq
