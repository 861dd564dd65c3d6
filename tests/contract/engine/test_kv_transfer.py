"""Disaggregated prefill on the real default model: engine A (kv_producer) computes each prompt and pins its KV;
engine B (kv_consumer) fetches that KV over TCP and decodes. B's greedy tokens equal A's own decoding of the same
prompts, for 32 prompts (short, long, sharing prefixes, chat) batched together, with prefix-cache hits on A, n > 1
(seeded sampling) and structured outputs. Every fault ends with the same tokens (B computes the prompt itself) and
every KV block back in both pools: pins expired, a producer gone, a producer that never answers (timed out, and
aborted mid-fetch), a prompt or a layout that differs. Requests for a hop an engine does not take are refused. The
engines share a key (the producer signs its answers, the consumer fetches only signed ones): the faults' stand-ins
sign the answers they redirect to themselves with it."""

import json
import os
import socket
import threading
import time
from dataclasses import replace

import jsonschema
import pytest

from tests.support.kv_transfer import (
    MAX_NEW,
    PREFILL_HOP,
    PROMPTS,
    decode_hop,
    greedy,
    kv_engine,
    prefill_hops,
    redirected,
    run,
)
from tokenweir.engine.config import KVTransferConfig
from tokenweir.engine.core.errors import RequestError
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
DTYPE = os.environ.get("TOKENWEIR_TEST_DTYPE", "auto")  # a GPU check runs bfloat16 and float32


def engine(role: str) -> LLM:
    return kv_engine(role, dtype=DTYPE)


@pytest.fixture(scope="module")
def producer() -> LLM:
    return engine("kv_producer")


@pytest.fixture(scope="module")
def consumer() -> LLM:
    return engine("kv_consumer")


def assert_pools_whole(*llms: LLM) -> None:
    """Every block of every pool is free again (cached prefixes count as free), no pin or fetch is left. A pin is
    freed once the producer has read the consumer's confirmation, which may come just after the consumer is done."""
    for llm in llms:
        eng = llm.engine
        deadline = time.monotonic() + 5
        transfer = eng.kv_transfer
        pins = transfer.pins if transfer is not None else None
        eng.collect_transfers()
        while pins is not None and len(pins) and time.monotonic() < deadline:
            time.sleep(0.01)
            eng.collect_transfers()
        assert not eng.has_unfinished_requests()
        assert pins is None or len(pins) == 0
        assert transfer is None or (not transfer.fetches and not transfer.remote)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_decode_hops_give_one_engines_tokens_for_32_prompts(producer, consumer):
    expected = run(producer, PROMPTS, [greedy()] * len(PROMPTS))
    answers = prefill_hops(producer, PROMPTS)  # A computes from its prefix cache: every prompt was just run there
    assert producer.engine.kv_transfer.pins.num_blocks > 0
    fetched_before = consumer.engine.kv_transfer.fetched_bytes
    got = run(consumer, PROMPTS, [decode_hop(greedy(), a) for a in answers])
    assert got == expected
    assert consumer.engine.kv_transfer.num_fetch_failures == 0
    layout = consumer.engine.kv_transfer.layout
    num_remote = sum(-(-(len(consumer.engine.tokenizer.encode(p)) - 1) // layout.block_size) for p in PROMPTS)
    assert consumer.engine.kv_transfer.fetched_bytes - fetched_before == num_remote * layout.block_bytes
    assert_pools_whole(producer, consumer)


def test_n_choices_and_structured_outputs_through_both_hops(producer, consumer):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    prompts = PROMPTS[1:5] + ["Name a city and its country as JSON:", PROMPTS[4]]
    params = [SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=MAX_NEW)] * 4
    params += [greedy(48, structured=fmt), greedy(24, structured={"type": "json_object"})]
    expected = run(producer, prompts, params)
    answers = prefill_hops(producer, prompts)
    got = run(consumer, prompts, [decode_hop(p, a) for p, a in zip(params, answers, strict=True)])
    assert got == expected
    assert all(len(choices) == 3 and len({tuple(c) for c in choices}) > 1 for choices in got[:4])
    text = consumer.engine.tokenizer.decode(got[4][0])
    jsonschema.validate(json.loads(text), schema)
    assert consumer.engine.kv_transfer.num_fetch_failures == 0
    assert_pools_whole(producer, consumer)


def fresh(prompts: list[str], tag: str) -> list[str]:
    """The prompts under a new first block, so no engine holds them in its prefix cache yet."""
    return [f"[{tag}] {p}" for p in prompts]


def recomputed(consumer: LLM, prompts: list[str], answers: list[dict]) -> list[list[list[int]]]:
    """Decode hops whose fetch is expected to fail: each must be counted, and computed here instead."""
    failures = consumer.engine.kv_transfer.num_fetch_failures
    got = run(consumer, prompts, [decode_hop(greedy(), a) for a in answers])
    assert consumer.engine.kv_transfer.num_fetch_failures - failures == len(prompts)
    return got


def test_expired_pins_are_freed_and_the_consumer_computes_the_prompt(producer, consumer):
    prompts = fresh(PROMPTS[4:7], "expired")
    expected = run(producer, prompts, [greedy()] * 3)
    producer.engine.kv_transfer.pins.timeout_s = 0.05
    try:
        answers = prefill_hops(producer, prompts)
    finally:
        producer.engine.kv_transfer.pins.timeout_s = KVTransferConfig().pin_timeout_s
    time.sleep(0.1)
    expired = producer.engine.kv_transfer.pins.num_expired
    assert_pools_whole(producer)
    assert producer.engine.kv_transfer.pins.num_expired - expired == 3
    assert recomputed(consumer, prompts, answers) == expected
    assert_pools_whole(producer, consumer)


def test_a_prompt_or_a_layout_that_differs_is_refused_and_the_pin_stays_for_the_right_consumer(producer, consumer):
    # prompts of one length, so each decode hop tries to fetch the other one's transfer
    prompts = fresh([PROMPTS[5], PROMPTS[5].replace("largest", "smallest")], "differs")
    expected = run(producer, prompts, [greedy()] * 2)
    answers = prefill_hops(producer, prompts)
    swapped = recomputed(consumer, prompts, answers[::-1])  # each decode hop names the other prompt's transfer
    assert swapped == expected
    fetcher = consumer.engine.kv_transfer.fetcher
    layout = fetcher.layout
    fetcher.layout = replace(layout, model_digest="0" * 16)
    try:
        assert recomputed(consumer, prompts, answers) == expected
    finally:
        fetcher.layout = layout
    assert len(producer.engine.kv_transfer.pins) == 2  # refused fetches leave the pins
    assert run(consumer, prompts, [decode_hop(greedy(), a) for a in answers]) == expected
    assert_pools_whole(producer, consumer)


def expire_pins(producer: LLM) -> None:
    later = time.monotonic() + producer.engine.kv_transfer.pins.timeout_s + 1
    producer.engine.kv_transfer.pins.collect(producer.engine.block_manager.free, now=later)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SilentProducer:
    """Accepts connections and never answers: a producer hung mid-transfer."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.listener.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


def test_a_producer_gone_or_hung_times_out_and_the_consumer_computes_the_prompt(producer, consumer):
    prompts = fresh(PROMPTS[9:11], "gone")
    expected = run(producer, prompts, [greedy()] * 2)
    answers = prefill_hops(producer, prompts)
    gone = [redirected(a, closed_port()) for a in answers]
    assert recomputed(consumer, prompts, gone) == expected
    silent = SilentProducer()
    fetcher = consumer.engine.kv_transfer.fetcher
    fetcher.timeout_s = 0.5
    try:
        start = time.monotonic()
        assert recomputed(consumer, prompts, [redirected(a, silent.port) for a in answers]) == expected
        assert time.monotonic() - start >= 0.5
    finally:
        fetcher.timeout_s = 5.0
        silent.close()
    expire_pins(producer)  # the pins nobody fetched
    assert_pools_whole(producer, consumer)


class CutProducer:
    """Relays a consumer's fetch to the real producer and cuts both connections once `limit` bytes of the answer
    (its header line, then blocks) have passed: a producer that dies in the middle of sending the blocks."""

    def __init__(self, producer_port: int, limit: int) -> None:
        self.producer_port, self.limit = producer_port, limit
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.relayed: list[int] = []  # bytes passed on, per connection
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()[0]
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(("127.0.0.1", self.producer_port)) as upstream:
            conn.settimeout(5)
            upstream.settimeout(5)
            upstream.sendall(conn.makefile("rb").readline())  # the consumer's request line
            passed = 0
            while passed < self.limit:
                data = upstream.recv(min(65536, self.limit - passed))
                if not data:
                    break
                conn.sendall(data)
                passed += len(data)
            self.relayed.append(passed)
        # both closed here, the consumer's half-way through its blocks

    def close(self) -> None:
        self.listener.close()


def test_a_producer_cut_off_mid_transfer_leaves_the_prompt_to_the_consumer(producer, consumer):
    prompts = fresh(PROMPTS[4:5], "cut")  # ~600 tokens: ~37 blocks
    expected = run(producer, prompts, [greedy()])
    answers = prefill_hops(producer, prompts)
    block_bytes = consumer.engine.kv_transfer.layout.block_bytes
    limit = 9 * block_bytes + block_bytes // 2  # the header line, 9 blocks, part of the 10th
    cut = CutProducer(answers[0]["remote_port"], limit)
    try:
        received = consumer.engine.kv_transfer.fetched_bytes
        assert recomputed(consumer, prompts, [redirected(answers[0], cut.port)]) == expected
        assert cut.relayed == [limit]
        # one group of 8 written, then the cut
        assert consumer.engine.kv_transfer.fetched_bytes - received == 8 * block_bytes
    finally:
        cut.close()
    expire_pins(producer)  # the producer never heard the consumer's confirmation
    assert_pools_whole(producer, consumer)


def test_a_request_aborted_mid_fetch_gives_its_blocks_back_once_the_fetch_stops(producer, consumer):
    prompt = fresh(PROMPTS[4:5], "aborted")[0]
    answers = prefill_hops(producer, [prompt])
    silent = SilentProducer()
    eng = consumer.engine
    eng.kv_transfer.fetcher.timeout_s = 0.5
    try:
        params = decode_hop(greedy(), redirected(answers[0], silent.port))
        tokens = eng.tokenizer.encode(prompt)
        eng.validate(tokens, params)
        eng.add_request("aborted-mid-fetch", tokens, params)
        eng.step()
        assert len(eng.scheduler.fetching) == 1 and eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
        [final] = eng.abort_request("aborted-mid-fetch")
        assert final.finished and final.finish_reason == "abort"
        assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks  # the fetch may still write them
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        eng.kv_transfer.fetcher.timeout_s = 5.0
        silent.close()
    expire_pins(producer)  # the pins nobody fetched
    assert_pools_whole(producer, consumer)


@pytest.mark.parametrize(
    ("role", "kv_transfer_params", "code"),
    [
        ("consumer", PREFILL_HOP, "kv_transfer_unsupported"),
        ("producer", {"do_remote_prefill": True}, "kv_transfer_unsupported"),
        ("consumer", {"do_remote_prefill": True, "remote_host": "127.0.0.1"}, "invalid_kv_transfer_params"),
        ("consumer", {"remote_port": 1}, "invalid_kv_transfer_params"),
    ],
)
def test_a_hop_the_engine_does_not_take_is_refused(producer, consumer, role, kv_transfer_params, code):
    llm = consumer if role == "consumer" else producer
    with pytest.raises(RequestError) as info:
        llm.engine.validate([1, 2, 3], greedy(kv_transfer_params=kv_transfer_params))
    assert info.value.code == code and info.value.param == "kv_transfer_params"


def test_prompt_logprobs_are_computed_by_the_consumer_and_the_pin_let_go(producer, consumer):
    prompts = fresh(PROMPTS[2:3], "logprobs")
    params = greedy(prompt_logprobs=1)
    run(producer, prompts, [params])
    [expected] = run.finals  # type: ignore[attr-defined]
    answers = prefill_hops(producer, prompts)
    fetches = consumer.engine.kv_transfer.num_fetches
    run(consumer, prompts, [decode_hop(params, answers[0])])
    [got] = run.finals  # type: ignore[attr-defined]
    assert [p and p.token_id for p in got.prompt_logprobs] == [p and p.token_id for p in expected.prompt_logprobs]
    assert len(got.prompt_logprobs) == len(consumer.engine.tokenizer.encode(prompts[0]))
    assert consumer.engine.kv_transfer.num_fetches == fetches  # every prompt position computed here
    assert_pools_whole(producer, consumer)  # the producer's pin freed by the consumer's release, not by its timeout
