"""A scripted canary rollout in a running lab, through nginx and the admin API only: one canary promoted, one rolled
back. `python -m deploy.lab --canary` runs it after the locust run.

1. promote: a pool `smollm2-135m-next` (engine-2 under a new name: the same model file, as a re-deploy would be)
   becomes the canary of an alias `smollm2` over the main pool; its share steps 25 -> 50 -> 100% while its error
   rate and TTFT/TPOT p95 hold against the baseline's, then it is promoted.
2. roll back: a pool `smollm2-135m-broken` whose one member does not answer (a release whose pods never came up;
   it falls back to the main pool, so clients see no error) becomes the canary; the first window with enough of
   its requests rolls it back on both gateway replicas.

Chat requests from many users (sticky per `user`) keep flowing through nginx meanwhile; each phase prints a row per
poll of /admin/rollouts (as the replica nginx picked sees it) and the clients' status codes.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from deploy import render
from deploy.lab_procs import Lab, LabError

ALIAS = "smollm2"
NEXT, BROKEN = f"{render.MODEL}-next", f"{render.MODEL}-broken"
ROLLOUT = {"steps": [25, 50, 100], "step_s": 8, "window_s": 60, "min_requests": 6}


def _pool(model: str, url: str, name: str, **extra) -> dict:
    # the engines serve MODEL under that name whatever the pool's public name is
    member = {"base_url": url, "name": name, "model": render.MODEL, "api_key_env": render.ENGINE_KEY_ENV}
    return {"model": model, "tokenizer": "default", "max_context": 2048, "upstreams": [member], **extra}


def _alias(canary_pool: str) -> dict:
    variants = [{"pool": render.MODEL, "name": "stable"}, {"pool": canary_pool, "name": "canary"}]
    rollout = {"canary": "canary", "baseline": "stable", **ROLLOUT}
    return {"model": ALIAS, "sticky": "user", "variants": variants, "rollout": rollout}


class Load:
    """Chats for the alias from random users, `workers` at a time, until stopped; status codes counted."""

    def __init__(self, url: str, key: str, workers: int = 4) -> None:
        self.url, self.key, self.workers = url, key, workers
        self.statuses: Counter = Counter()
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(workers)

    def __enter__(self) -> Load:
        for _ in range(self.workers):
            self.pool.submit(self._run)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.pool.shutdown(wait=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.key}"}, timeout=120) as c:
            while not self.stop.is_set():
                body = {
                    "model": ALIAS,
                    "messages": [{"role": "user", "content": "Name one colour."}],
                    "max_tokens": 8,
                    "user": uuid.uuid4().hex,
                }
                try:
                    self.statuses[c.post("/v1/chat/completions", json=body).status_code] += 1
                except httpx.HTTPError as e:
                    self.statuses[type(e).__name__] += 1


def _row(elapsed: float, state: dict, statuses: Counter) -> str:
    r = state["rollout"]
    wins = r["windows"]
    cells = []
    for name in ("canary", "stable"):
        w = wins[name]
        cells.append(f"{w['requests']:>4} {w['error_rate']:>6.1%} {w['ttft_p95_ms'] or 0:>8.1f}")
    codes = " ".join(f"{k}:{v}" for k, v in sorted(statuses.items(), key=str))
    share = f"{r['canary_share']:>6.0f}%"
    return f"{elapsed:>6.1f} | {r['status']:<11} {r['step']:>4} {share} | {' | '.join(cells)} | {codes}"


HEADER = (
    f"{'t (s)':>6} | {'status':<11} {'step':>4} {'share':>7} | canary: {'n':>2} {'err':>6} {'TTFT p95':>8} | "
    f"stable: {'n':>2} {'err':>6} {'TTFT p95':>8} | clients"
)


def _phase(
    admin: httpx.Client, load_url: str, key: str, done: str, timeout_s: float, out: Callable[[str], None]
) -> dict:
    out(HEADER)
    started = time.monotonic()
    with Load(load_url, key) as load:
        while True:
            state = admin.get(f"/admin/aliases/{ALIAS}").json()
            elapsed = time.monotonic() - started
            if "rollout" not in state:  # nginx asked the replica that has not polled the change yet (<= 1 s)
                time.sleep(0.5)
                continue
            out(_row(elapsed, state, load.statuses))
            if state["rollout"]["status"] == done:
                break
            if elapsed > timeout_s:
                raise LabError(f"the rollout did not reach {done} in {timeout_s:g} s: {state['rollout']}")
            time.sleep(2)
    return {"seconds": round(elapsed, 1), "rollout": state["rollout"], "weights": state["weights"], **load.statuses}


def run_canary(lab: Lab, out: Callable[[str], None] = print, timeout_s: float = 240) -> dict:
    """Both phases; returns what each ended with. Raises LabError when a phase does not end as it should."""
    if not lab.admin_key:
        raise LabError("no admin key")
    with httpx.Client(base_url=lab.nginx_url, headers={"authorization": f"Bearer {lab.admin_key}"}, timeout=30) as a:
        team = a.post("/admin/teams", json={"name": f"canary-{uuid.uuid4().hex[:6]}"}).json()
        key = a.post(f"/admin/teams/{team['id']}/keys", json={"name": "canary"}).json()["secret"]
        engine_2, nowhere = lab.engine_urls()[1], f"http://127.0.0.1:{lab.ports['down']}"
        results = {}
        for phase, pool, done in (
            ("promote", _pool(NEXT, engine_2, "engine-2-next"), "promoted"),
            ("roll back", _pool(BROKEN, nowhere, "broken", fallbacks=[render.MODEL]), "rolled_back"),
        ):
            out(f"\ncanary rollout, {phase}: alias {ALIAS} = stable {render.MODEL} + canary {pool['model']} {ROLLOUT}")
            writes = [(f"/admin/pools/{pool['model']}", pool), (f"/admin/aliases/{ALIAS}", _alias(pool["model"]))]
            for path, body in writes:
                r = a.put(path, json=body)
                if r.status_code != 200:
                    raise LabError(f"PUT {path}: {r.status_code} {r.text}")
            results[phase] = _phase(a, lab.nginx_url, key, done, timeout_s, out)
            out(f"{phase}: {results[phase]['rollout']['status']} ({results[phase]['rollout']['reason']})")
        return results
