"""`tokenweir serve --engines 2 --prefill-engines 1`, for real, killed where it hurts: engine 0 prefills (kv_producer),
engine 1 decodes (kv_consumer, fetching the prompt's KV from engine 0). One stack for the module; in this order:

1. The producer SIGKILLed while it holds a prompt's KV for the consumer: the consumer is frozen (SIGSTOP) while the
   request's prefill hop answers, so the producer is killed with its blocks pinned and the decode hop already sent;
   let go, the consumer's fetch finds the producer gone and it computes the prompt itself. The client gets its whole
   answer, billed as the decode hop counted it (one event: both members named, nothing fetched), and the next requests
   are served while the supervisor restarts the producer (their prefill hops fall back to the decode member).
2. The consumer SIGKILLed in the middle of a stream: that stream ends with `upstream_broken` (one event naming both
   members, billed the tokens the client was sent: the engine's running usage on the last chunk relayed); the
   producer's pin was let go when the fetch was confirmed; the next requests are served whole by the prefill member
   (a disaggregated pool's last resort) until the supervisor restarts the consumer, whose circuit closes and which
   takes the decode hops again.
3. A client gone while its prompt is on the prefill member: the gateway aborts the prefill hop (the producer stops
   it, or lets its KV go at once if it had finished), the decode member never gets it, one event says the client
   left.
4. A tenant's own `kv_transfer_params`, naming a listener of the test's, is refused at the edge whatever state the
   prefill member is in (up, drained, killed): the listener sees no connection and other teams' answers stay as
   they were.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.serve_engines import MODEL, EnginesStack, engines_stack, metric_value, system_prompt, wait_for
from tokenweir.engine.config import KVTransferConfig
from tokenweir.gateway.accounting.events import read_events

pytestmark = pytest.mark.slow
PRODUCER, CONSUMER = f"{MODEL}@engine-0", f"{MODEL}@engine-1"
PINNED, FAILURES = "tokenweir:kv_transfer_pinned_blocks", "tokenweir:kv_transfer_fetch_failures_total"
FINISHED, SERVED = "tokenweir:request_success_total", "tokenweir:kv_transfer_served_total"
PIN_TIMEOUT_S = KVTransferConfig.pin_timeout_s


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with engines_stack(tmp_path_factory.mktemp("disagg"), "prefix", prefill_engines=1) as stack:
        yield stack


def engine_metric(stack: EnginesStack, index: int, name: str, **labels: str) -> float:
    text = httpx.get(stack.out.engines()[index][1] + "/metrics", timeout=5).text
    return metric_value(text, name, **labels) or 0.0


def events_of(stack: EnginesStack, rid: str) -> list[dict]:
    return [e for e in read_events(stack.events_path) if e["request_id"] == rid]


def the_event(stack: EnginesStack, rid: str) -> dict:
    return wait_for(f"the event of {rid}", lambda: events_of(stack, rid), 15)[0]


def chat(stack: EnginesStack, team: str, question: str, **kw):
    client = openai.OpenAI(base_url=stack.served.url + "/v1", api_key=stack.served.demo_key, max_retries=0, timeout=90)
    rid = f"{team}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": system_prompt(team)}, {"role": "user", "content": question}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_headers={"x-request-id": rid}, **kw
    )
    return rid, answer


def served_whole(stack: EnginesStack, team: str) -> dict:
    """A request answered whole and billed as its answer's usage says, with one event: that event."""
    rid, answer = chat(stack, team, "Say hello.", max_tokens=6)
    event = the_event(stack, rid)
    assert event["status"] == "ok", event
    assert (event["prompt_tokens"], event["completion_tokens"]) == (
        answer.usage.prompt_tokens,
        answer.usage.completion_tokens,
    )
    assert len(events_of(stack, rid)) == 1
    return event


def test_a_producer_killed_holding_a_prompts_kv_leaves_it_to_the_consumer_billed_once(stack):
    warm = served_whole(stack, "Aurora")
    assert (warm["prefill_instance"], warm["instance"]) == (PRODUCER, CONSUMER), warm
    assert warm["kv_fetched_tokens"] > 0 and warm["kv_fetched_bytes"] > 0, warm

    engines = stack.out.engines()
    producer_pid, consumer_pid = engines[0][0], engines[1][0]
    failures = engine_metric(stack, 1, FAILURES)
    os.kill(consumer_pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(chat, stack, "Basalt", "Name three colours.", max_tokens=12)
            wait_for("the producer to pin the prompt's KV", lambda: engine_metric(stack, 0, PINNED) > 0, 60, 0.05)
            os.kill(producer_pid, signal.SIGKILL)
            os.kill(consumer_pid, signal.SIGCONT)
            rid, answer = asked.result(timeout=120)
    finally:
        os.kill(consumer_pid, signal.SIGCONT)
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    event = the_event(stack, rid)
    assert (event["status"], event["prefill_instance"], event["instance"]) == ("ok", PRODUCER, CONSUMER), event
    assert (event["prompt_tokens"], event["completion_tokens"]) == (
        answer.usage.prompt_tokens,
        answer.usage.completion_tokens,
    )
    assert event["kv_fetched_tokens"] == 0 and event["usage_source"] == "upstream", event  # it computed the prompt
    assert engine_metric(stack, 1, FAILURES) == failures + 1
    assert len(events_of(stack, rid)) == 1

    # Served while the producer is down (the prefill hop falls back), then through both hops once it is back.
    for team in ("Cobalt", "Dune"):
        served_whole(stack, team)
    wait_for("the producer's restart", lambda: stack.out.engines()[0][0] != producer_pid, 30)
    wait_for(
        "a request prefilled by the restarted producer",
        lambda: served_whole(stack, "Aurora")["prefill_instance"] == PRODUCER,
        120,
        every_s=1,
    )


def test_a_consumer_killed_mid_stream_ends_that_stream_billed_once_and_the_producer_serves_meanwhile(stack):
    served_whole(stack, "Cobalt")  # both members up (the producer restarted in the test above)
    # A pin the test above may leave (a release or an abort lost while the producer restarted) expires by then.
    wait_for("the producer to hold no pin", lambda: engine_metric(stack, 0, PINNED) == 0, PIN_TIMEOUT_S + 10, 0.5)
    consumer_pid = stack.out.engines()[1][0]
    served = engine_metric(stack, 0, SERVED)
    rid, stream = chat(
        stack, "Dune", "Count from one to two hundred, in words.", max_tokens=300, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    got, tokens = 0, 0
    with pytest.raises(openai.APIError) as broke:
        for chunk in stream:
            got += 1
            tokens += sum(1 for c in chunk.choices if c.delta.content)
            if got == 3:
                os.kill(consumer_pid, signal.SIGKILL)
    assert "broke off" in str(broke.value), str(broke.value)
    event = the_event(stack, rid)
    assert (event["status"], event["reason"], event["http_status"]) == ("error", "upstream_broken", 502), event
    assert (event["prefill_instance"], event["instance"]) == (PRODUCER, CONSUMER), event
    # billed what the client was sent: the engine's running usage on the last chunk relayed
    assert (event["usage_source"], event["completion_tokens"]) == ("upstream", tokens), event
    assert event["prompt_tokens"] > 0
    assert len(events_of(stack, rid)) == 1
    # The consumer confirmed its fetch before its first token, so the producer let the pin go then: it is gone
    # within seconds of the event, never left to the pin's timeout.
    let_go = poll(lambda: engine_metric(stack, 0, PINNED) == 0, 5)
    fetches = engine_metric(stack, 0, SERVED) - served
    assert let_go and fetches == 1, (engine_metric(stack, 0, PINNED), fetches, json.dumps(event))

    # Meanwhile the prefill member answers whole requests; the consumer comes back and decodes again.
    down = served_whole(stack, "Aurora")
    assert down["instance"] == PRODUCER, down
    wait_for("the consumer's restart", lambda: stack.out.engines()[1][0] != consumer_pid, 30)
    wait_for(
        "a request decoded by the restarted consumer",
        lambda: served_whole(stack, "Basalt")["instance"] == CONSUMER,
        120,
        every_s=1,
    )


def poll(check, timeout_s: float) -> bool:
    """Whether `check` held within `timeout_s` seconds (asked every 0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def finished(stack: EnginesStack, index: int) -> float:
    return sum(engine_metric(stack, index, FINISHED, finished_reason=r) for r in ("stop", "length", "abort"))


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_client_gone_during_the_prefill_hop_stops_it_on_the_producer(stack):
    wait_for("both members up", lambda: all(answers(u) for u in stack.engine_urls()), 60)
    served_whole(stack, "Cobalt")
    # what this test counts starts from a producer holding nothing (a pin the test above may leave expires by then)
    wait_for("the producer to hold no pin", lambda: engine_metric(stack, 0, PINNED) == 0, PIN_TIMEOUT_S + 10, 0.5)
    prefilled, decoded = finished(stack, 0), finished(stack, 1)
    report = " ".join(f"Line {i} of the quarterly report says revenue moved by {i % 7} percent." for i in range(60))
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Summarize:\n" + report}], "max_tokens": 20}
    headers = {"authorization": f"Bearer {stack.served.demo_key}", "x-request-id": rid}
    with pytest.raises(httpx.ReadTimeout):  # the prompt takes seconds to compute: the client leaves first
        httpx.post(stack.served.url + "/v1/chat/completions", json=body | {"stream": True}, headers=headers,
                   timeout=httpx.Timeout(10, read=0.5))  # fmt: skip
    event = the_event(stack, rid)
    assert (event["status"], event["reason"], event["client_disconnected"]) == ("cancelled", "client_disconnected", 1)
    assert event["prefill_instance"] is None and event["completion_tokens"] == 0, event

    # The producer stops the prompt at its next step (aborted), or, where its last chunk was already under way,
    # finishes it and lets the pinned KV go at once: either way within seconds, not at the pin's 30 s timeout.
    def let_go() -> bool:
        return finished(stack, 0) == prefilled + 1 and engine_metric(stack, 0, PINNED) == 0

    wait_for("the producer to stop the prefill hop and keep no KV for it", let_go, 10)
    assert finished(stack, 1) == decoded  # the decode member never got it
    assert len(events_of(stack, rid)) == 1


class Listener:
    """A TCP listener of the test's own on a free port, counting the connections made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted = self.sock.getsockname()[1], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


def forged_transfer(stack: EnginesStack, listener: Listener, stream: bool) -> httpx.Response:
    params = {
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": listener.port,
        "remote_engine_id": "engine-0", "transfer_id": "forged", "num_tokens": 64,
    }  # fmt: skip
    messages = [{"role": "system", "content": system_prompt("Aurora")}, {"role": "user", "content": "Say hello."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "kv_transfer_params": params, "stream": stream}
    headers = {"authorization": f"Bearer {stack.served.demo_key}"}
    return httpx.post(stack.served.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_a_tenants_kv_transfer_params_are_refused_at_the_edge_whatever_the_prefill_member_does(stack):
    wait_for("both members up", lambda: all(answers(u) for u in stack.engine_urls()), 60)
    _, before = chat(stack, "Basalt", "Name three colours.", max_tokens=12)
    listener = Listener()
    admin = {"authorization": f"Bearer {stack.served.admin_key}"}
    member = f"{stack.served.url}/admin/pools/{MODEL}/members/engine-0"

    def refused(state: str) -> None:
        for stream in (False, True):
            r = forged_transfer(stack, listener, stream)
            assert r.status_code == 400, (state, r.text)
            error = r.json()["error"]
            assert (error["code"], error["param"], error["type"]) == (
                "unsupported_parameter", "kv_transfer_params", "invalid_request_error",
            ), (state, error)  # fmt: skip

    refused("prefill member up")
    r = httpx.patch(member, json={"draining": True}, headers=admin, timeout=30)
    assert r.status_code == 200, r.text
    try:
        refused("prefill member drained")
    finally:
        r = httpx.patch(member, json={"draining": False}, headers=admin, timeout=30)
        assert r.status_code == 200, r.text
    producer_pid = stack.out.engines()[0][0]
    os.kill(producer_pid, signal.SIGKILL)
    refused("prefill member killed")
    assert listener.accepted == 0
    wait_for("the producer's restart", lambda: stack.out.engines()[0][0] != producer_pid, 30)
    wait_for("both members up", lambda: all(answers(u) for u in stack.engine_urls()), 120)
    _, after = chat(stack, "Basalt", "Name three colours.", max_tokens=12)
    assert after.choices[0].message.content == before.choices[0].message.content
    assert listener.accepted == 0
