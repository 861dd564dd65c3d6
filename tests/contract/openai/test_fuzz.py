"""Schemathesis against the gateway's own OpenAPI document: no input may get a 5xx or leave a traceback.

The real app (lifespan, middleware, admission) runs in-process through schemathesis' ASGI transport, in front of the
fake upstream over real HTTP, with a team key for /v1 and an admin key for /admin. Every operation gets
schemathesis' coverage cases (boundary and schema-violating values, deterministic) and then Hypothesis-generated
cases, positive and negative, derandomized so a run is reproducible. Positive cases name a served model (an engine
pool or an external one) or a real team (two times in three for generated ones), so they get past the 404s, into
admission and the upstream, or the store.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time

import pytest
import schemathesis  # the `dev` extra: a missing fuzzer must fail the run, not skip it
import structlog
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.config import GenerationConfig
from schemathesis.core import NotSet
from schemathesis.python import asgi as schemathesis_asgi

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread
from tokenweir.gateway.app import create_app
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store

MODEL = "fake-model"  # served by the fake as if it were our engine (text only, /abort, exact usage)
EXTERNAL = "external-model"  # the same fake as an external OpenAI-compatible upstream (estimates, any part type)
MIN_CASES = 5_000
# Hypothesis examples per operation and generation mode (positive, negative). A chat body is large (dozens of
# optional fields, nested unions): ~50 ms to generate one on a slow machine, so it gets fewer; operations with few
# inputs run out of distinct cases before their budget anyway.
EXAMPLES = {
    "POST /v1/chat/completions": 100,
    "POST /v1/completions": 250,
    "POST /v1/embeddings": 150,
    "GET /v1/models/{model_id}": 80,
    "POST /admin/teams": 250,
    "PUT /admin/teams/{team_id}/limits": 250,
    "PATCH /admin/teams/{team_id}": 150,
    "POST /admin/teams/{team_id}/keys": 150,
    "POST /admin/keys": 150,
    "GET /admin/usage": 150,
    "GET /admin/keys": 100,
}
DEFAULT_EXAMPLES = 80
SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],  # failures are collected, not raised: nothing to shrink
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team = store.create_team("fuzz-team")
    target = store.create_team("fuzz-target")  # the admin cases' real team (they may rename or disable it)
    team_secret, _ = store.create_key(team.id, "fuzz")
    admin_secret, _ = store.create_key(None, "fuzz-admin", is_admin=True)
    fake = FakeUpstream(model=MODEL)
    with ServerThread(fake) as upstream:
        config = GatewayConfig(
            port=0,
            pools=[
                PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)], max_context=4096),
                PoolConfig(
                    model=EXTERNAL,
                    upstreams=[UpstreamConfig(upstream.url, model=MODEL, engine=False)],
                    max_context=32768,
                ),
            ],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.5),
            usage_flush_interval_s=0.5,
            max_body_bytes=256 * 1024,
        )
        app = create_app(config, store=store)
        with structlog.testing.capture_logs() as logs:
            schema = schemathesis.openapi.from_asgi("/openapi.json", app)  # starts the app's lifespan
            try:
                yield {
                    "schema": schema,
                    "team": team_secret,
                    "admin": admin_secret,
                    "target": target.id,
                    "logs": logs,
                    "fake": fake,
                }
            finally:
                schemathesis_asgi.shutdown_lifespans()
    store.close()


def _shown(op, case) -> str:
    """The request, plainly (schemathesis' curl rendering masks fields named like secrets, 'max_tokens' too)."""
    body = None if isinstance(case.body, NotSet) else case.body
    return f"{op.label} path={case.path_parameters} query={case.query} body={body!r}"[:800]


def _aimed(case, model: str | None, target_team: str):
    """Positive cases name what exists (a served model, a real team), so they get past the 404s; None: as generated."""
    if model is not None and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = model
    if model is not None and "team_id" in (case.path_parameters or {}) and case.method.upper() != "DELETE":
        case.path_parameters["team_id"] = target_team
    if model is not None and "model_id" in (case.path_parameters or {}):
        case.path_parameters["model_id"] = model
    return case


def test_fuzz_never_answers_5xx_nor_logs_a_traceback(fuzz_env, caplog):
    schema = fuzz_env["schema"]
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path.startswith(("/v1/", "/admin/"))]
    labels = {op.label for op in operations}
    assert {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/embeddings",
        "GET /v1/models",
        "GET /v1/models/{model_id}",
        "POST /admin/teams",
    } <= labels
    statuses: collections.Counter = collections.Counter()
    per_operation: collections.Counter = collections.Counter()
    answered: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    started = time.perf_counter()

    def send(op, case) -> None:
        key = fuzz_env["team"] if op.path.startswith("/v1/") else fuzz_env["admin"]
        try:
            response = case.call(headers={"Authorization": f"Bearer {key}"})
        except Exception as exc:  # the app raised through the transport: as bad as a 500
            failures.append(f"{type(exc).__name__}: {exc} <- {_shown(op, case)}")
            return
        statuses[response.status_code] += 1
        per_operation[op.label] += 1
        answered[op.label][response.status_code] += 1
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {response.text[:300]} <- {_shown(op, case)}")

    caplog.set_level(logging.ERROR)
    for op in sorted(operations, key=lambda o: o.label):
        modes = list(GenerationMode)
        for case in schema.iter_coverage_cases(
            op, generation_modes=modes, generation_config=GenerationConfig(modes=modes)
        ):
            positive = case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE
            send(op, _aimed(case, MODEL if positive else None, fuzz_env["target"]))
        for mode in modes:
            strategy = op.as_strategy(generation_mode=mode)
            if mode == GenerationMode.POSITIVE:
                aims = st.sampled_from([None, MODEL, EXTERNAL])
                strategy = st.builds(_aimed, strategy, aims, st.just(fuzz_env["target"]))

            @settings(SETTINGS, max_examples=EXAMPLES.get(op.label, DEFAULT_EXAMPLES))
            @given(case=strategy)
            def run(case) -> None:
                send(op, case)  # noqa: B023 - run() is called right below, in this iteration

            with contextlib.suppress(Unsatisfiable):  # no negative case exists (an operation without inputs)
                run()

    total = sum(per_operation.values())
    elapsed = time.perf_counter() - started
    print(f"\nfuzz: {total} cases in {elapsed:.1f}s; statuses {dict(sorted(statuses.items()))}")
    for label, count in sorted(per_operation.items()):
        print(f"  {count:>6}  {label}  {dict(sorted(answered[label].items()))}")
    print(f"  upstream saw {fuzz_env['fake'].requests_seen} requests")
    logs = fuzz_env["logs"]
    bad_logs = [e for e in logs if e.get("log_level") in ("error", "critical") or "exc_info" in e]
    bad_logs += [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failures, f"{len(failures)} cases got a 5xx or an exception:\n" + "\n".join(failures[:20])
    assert not bad_logs, f"errors logged: {bad_logs[:5]}"
    assert total >= MIN_CASES, f"only {total} cases ran"
    assert all(per_operation[op.label] > 0 for op in operations), "an operation was never called"
    for label in (
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/embeddings",  # positive cases aimed at the external pool (the engine pool has no embeddings)
        "POST /admin/teams",
        "PUT /admin/teams/{team_id}/limits",
    ):
        assert answered[label][200] + answered[label][201] > 0, f"no valid case of {label} got through"
