"""Locust load for a tokenweir gateway (the lab's nginx, or one gateway): several teams with their own keys and
priorities, streaming and non-streaming chat, a shared-prefix mix (prefix cache), and a rate-limited team whose
429s are expected.

    locust -f loadtests/locustfile.py --headless -u 6 -r 6 -t 20s --host http://127.0.0.1:8080

Keys: TOKENWEIR_TEAM_KEYS='alpha=tw-...,beta=tw-...' uses existing keys; otherwise TOKENWEIR_ADMIN_KEY creates
the teams below (or reuses them by name) with their limits and a fresh key each, once per run.
Besides the HTTP requests, it reports custom events: request_type TTFT (time to the first streamed token, ms),
PROMPT_TOKENS / COMPLETION_TOKENS (response_length = tokens billed), REJECTED (a 429/503 shed, by reason).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time

import requests
from locust import HttpUser, between, events, task

MODEL = os.environ.get("TOKENWEIR_MODEL", "smollm2-135m")
# a pool that may be down (the local lab's canary: its fallback is MODEL); a share of requests goes to it
CANARY_MODEL = os.environ.get("TOKENWEIR_CANARY_MODEL")
MAX_TOKENS = int(os.environ.get("TOKENWEIR_MAX_TOKENS", "16"))

# name -> limits (PUT /admin/teams/{id}/limits). gamma's rpm is tight on purpose: its 429s show as rejections.
TEAMS = {
    "alpha": {"priority": 0, "weight": 3, "max_concurrency": 4},
    "beta": {"priority": 1, "weight": 1, "tokens_per_day": 500000, "max_concurrency": 4},
    "gamma": {"priority": 2, "weight": 1, "rpm": 6, "max_concurrency": 2},
}
SHARED_PREFIX = (
    "You are the support assistant of the tokenweir lab. Answer in one short sentence. Context: tokenweir is a "
    "multi-tenant inference gateway with budgets, rate limits, priority queues and fallbacks in front of paged-KV "
    "engines with prefix caching, continuous batching and chunked prefill. "
) * 3
QUESTIONS = [
    "What is a budget?",
    "What is a weir?",
    "Why queue requests?",
    "What does prefill mean?",
    "What is a token?",
    "Why cache prefixes?",
    "What is fairness?",
    "What is a circuit breaker?",
]

_keys: dict[str, str] = {}
_team_cycle = None


def _admin(host: str, admin_key: str, method: str, path: str, body=None):
    r = requests.request(
        method, host.rstrip("/") + path, json=body, timeout=10, headers={"Authorization": f"Bearer {admin_key}"}
    )
    return r


def provision(host: str, admin_key: str) -> dict[str, str]:
    """Create (or find) each team, set its limits, and make a key for this run."""
    keys = {}
    for name, limits in TEAMS.items():
        r = _admin(host, admin_key, "POST", "/admin/teams", {"name": name})
        if r.status_code == 409:
            teams = _admin(host, admin_key, "GET", "/admin/teams").json()["data"]
            team_id = next(t["id"] for t in teams if t["name"] == name)
        else:
            r.raise_for_status()
            team_id = r.json()["id"]
        _admin(host, admin_key, "PUT", f"/admin/teams/{team_id}/limits", limits).raise_for_status()
        r = _admin(host, admin_key, "POST", f"/admin/teams/{team_id}/keys", {"name": f"locust-{int(time.time())}"})
        r.raise_for_status()
        keys[name] = r.json()["secret"]
    return keys


@events.test_start.add_listener
def _on_start(environment, **_kw):
    global _team_cycle
    given = os.environ.get("TOKENWEIR_TEAM_KEYS", "")
    if given:
        _keys.update(dict(pair.split("=", 1) for pair in given.split(",") if "=" in pair))
    else:
        admin_key = os.environ.get("TOKENWEIR_ADMIN_KEY")
        if not admin_key:
            raise SystemExit("locustfile: set TOKENWEIR_TEAM_KEYS or TOKENWEIR_ADMIN_KEY")
        _keys.update(provision(environment.host, admin_key))
    _team_cycle = itertools.cycle(sorted(_keys))


def _event(environment, kind: str, name: str, value: float, length: int = 0) -> None:
    environment.events.request.fire(
        request_type=kind, name=name, response_time=value, response_length=length, exception=None, context={}
    )


class TeamUser(HttpUser):
    wait_time = between(0.2, 1.0)

    def on_start(self):
        self.team = next(_team_cycle) if _team_cycle else "anonymous"
        self.headers = {"Authorization": f"Bearer {_keys.get(self.team, '')}"}

    # ---- helpers
    def _body(self, content: str, *, stream: bool, system: str | None = None, model: str = MODEL) -> dict:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.team != "gamma" and random.random() < 0.2:
            body["priority"] = 2  # a request may lower its team's priority (batch work)
        return body

    def _shed(self, resp, name: str) -> bool:
        """A 429/503 shed is the gateway doing its job: a REJECTED event, not a locust failure."""
        if resp.status_code in (429, 503):
            try:
                reason = resp.json()["error"].get("code") or resp.json()["error"].get("type")
            except (ValueError, KeyError, TypeError, AttributeError):
                reason = str(resp.status_code)
            resp.success()
            _event(self.environment, "REJECTED", f"{self.team}:{reason}", 0)
            return True
        return False

    def _usage(self, usage: dict | None) -> None:
        if usage:
            _event(self.environment, "PROMPT_TOKENS", self.team, 0, int(usage.get("prompt_tokens") or 0))
            _event(self.environment, "COMPLETION_TOKENS", self.team, 0, int(usage.get("completion_tokens") or 0))

    def _chat(self, content: str, system: str | None, label: str, model: str = MODEL) -> None:
        name = f"chat {label} [{self.team}]"
        with self.client.post(
            "/v1/chat/completions",
            json=self._body(content, stream=False, system=system, model=model),
            headers=self.headers,
            name=name,
            catch_response=True,
            timeout=120,
        ) as resp:
            if self._shed(resp, name):
                return
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {resp.text[:200]}")
                return
            self._usage(resp.json().get("usage"))

    def _stream(self, content: str, system: str | None, label: str) -> None:
        name = f"stream {label} [{self.team}]"
        t0 = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions",
            json=self._body(content, stream=True, system=system),
            headers=self.headers,
            name=name,
            catch_response=True,
            stream=True,
            timeout=120,
        ) as resp:
            if self._shed(resp, name):
                return
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {resp.text[:200]}")
                return
            first, usage, error = None, None, None
            for raw in resp.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    break
                if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
                usage = chunk.get("usage") or usage
            if error is not None:
                resp.failure(f"stream error: {error}")
                return
            if first is not None:
                _event(self.environment, "TTFT", self.team, (first - t0) * 1000)
            self._usage(usage)

    # ---- the mix
    @task(3)
    def stream_short(self):
        self._stream(random.choice(QUESTIONS), None, "short")

    @task(2)
    def chat_short(self):
        self._chat(random.choice(QUESTIONS), None, "short")

    @task(3)
    def stream_shared_prefix(self):
        self._stream(random.choice(QUESTIONS), SHARED_PREFIX, "shared-prefix")

    @task(1)
    def chat_canary(self):
        if CANARY_MODEL:
            self._chat(random.choice(QUESTIONS), None, "canary", model=CANARY_MODEL)

    @task(1)
    def chat_shared_prefix(self):
        self._chat(random.choice(QUESTIONS), SHARED_PREFIX, "shared-prefix")
