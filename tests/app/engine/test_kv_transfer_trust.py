"""A kv_consumer on a tiny random Llama fetches KV only from producers it trusts. A decode hop whose kv_transfer_params
are forged (unsigned, signed with another key, or signed long ago) and name a listener of the test's own makes no
connection to it: the consumer computes the prompt itself, the request succeeds with the greedy tokens of an engine
that never saw the params, and its answer says `untrusted_producer`. A consumer with no key refuses even a well-formed
transfer; one listing a producer's address fetches from it unsigned; a signed transfer from a real producer is
fetched. A fetch that fails answers a coarse reason, its details going to the engine's log."""

import json
import logging
import socket
import threading
import time

import pytest

from tests.support.kv_transfer import KV_KEY, redirected
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.config import KVTransferConfig
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.kv_transfer.params import RemotePrefill, producer_answer
from tokenweir.engine.kv_transfer.trust import signed
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams

MAX_NEW = 12


def prompt(tag: int) -> list[int]:
    """70 tokens (4 full blocks and a part), the first block differing per tag: no engine has it cached yet."""
    return [tag % 250 + 2] + [(7 * i + 3) % 250 + 2 for i in range(69)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-trust")), seed=4, max_position_embeddings=512)


def engine(model_dir: str, role: str | None, **trust) -> LLM:
    kv = None if role is None else KVTransferConfig(kv_role=role, fetch_timeout_s=2.0, **trust)
    return LLM(model_dir, dtype="float32", quantization="none", num_kv_blocks=64, num_threads=1, kv_transfer=kv)


@pytest.fixture(scope="module")
def fresh(model_dir) -> LLM:
    """An engine that never sees any kv_transfer_params: the tokens to expect."""
    return engine(model_dir, None)


@pytest.fixture(scope="module")
def consumer(model_dir) -> LLM:
    return engine(model_dir, "kv_consumer", transfer_key=KV_KEY)


@pytest.fixture(scope="module")
def producer(model_dir) -> LLM:
    return engine(model_dir, "kv_producer", transfer_key=KV_KEY)


def generate(llm: LLM, tokens: list[int], kv_transfer_params: dict | None = None) -> RequestOutput:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, kv_transfer_params=kv_transfer_params)
    [out] = llm.generate([tokens], params)
    return out


def prefill_hop(producer: LLM, tokens: list[int]) -> dict:
    [out] = producer.generate(
        [tokens], SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    assert out.kv_transfer_params["do_remote_prefill"] is True
    return out.kv_transfer_params


class Listener:
    """A TCP listener on 127.0.0.1 that counts the connections it accepts and never answers (a connected fetch would
    hang until its timeout, long after the accept was counted)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return
            self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def listener():
    listening = Listener()
    yield listening
    listening.close()


def transfer_to(port: int, key: str | None, signed_at: float | None = None) -> dict:
    """A well-formed decode hop's kv_transfer_params naming 127.0.0.1:`port`, signed with `key` at `signed_at`."""
    remote = RemotePrefill("127.0.0.1", port, "forger", "a" * 32, 70)
    return producer_answer(signed(remote, key, 30.0, now=signed_at))


def assert_refused_and_computed(llm: LLM, fresh: LLM, tokens: list[int], params: dict, listener: Listener) -> None:
    fetched_bytes, fetches = llm.engine.kv_transfer.fetched_bytes, llm.engine.kv_transfer.num_fetches
    out = generate(llm, tokens, params)
    assert listener.accepted == 0
    assert out.new_token_ids == generate(fresh, tokens).new_token_ids
    answer = out.kv_transfer_params
    assert (answer["fetch_error"], answer["fetched_tokens"], answer["fetched_bytes"]) == ("untrusted_producer", 0, 0)
    assert llm.engine.kv_transfer.fetched_bytes == fetched_bytes and llm.engine.kv_transfer.num_fetches == fetches + 1
    pool = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize(
    ("tag", "key", "age_s"),
    [(1, None, 0.0), (2, "another-key-0123456789abcdef", 0.0), (3, KV_KEY, 3600.0)],
    ids=["unsigned", "another key", "signed an hour ago"],
)
def test_a_forged_transfer_connects_nowhere_and_the_consumer_computes_the_prompt(
    consumer, fresh, listener, tag, key, age_s
):
    forged = transfer_to(listener.port, key, time.time() - age_s)
    assert_refused_and_computed(consumer, fresh, prompt(tag), forged, listener)


def test_a_consumer_whose_cache_holds_the_prompt_does_not_call_an_untrusted_producer_either(consumer, listener, caplog):
    tokens = prompt(4)[:65]  # 4 full blocks and the last token, which is always computed
    generate(consumer, tokens)  # now in its prefix cache: the decode hop only tells the producer to let its pin go
    with caplog.at_level(logging.WARNING, logger="tokenweir.engine"):
        generate(consumer, tokens, transfer_to(listener.port, None))
        deadline = time.monotonic() + 5
        while consumer.engine.kv_transfer.fetcher.in_flight and time.monotonic() < deadline:
            consumer.engine.collect_transfers()
            time.sleep(0.01)
    assert any("not told to free" in r.getMessage() and "not signed" in r.getMessage() for r in caplog.records)
    assert listener.accepted == 0


def test_a_consumer_with_no_key_refuses_even_a_well_formed_transfer(model_dir, producer, fresh, listener):
    keyless = engine(model_dir, "kv_consumer")
    assert_refused_and_computed(keyless, fresh, prompt(5), transfer_to(listener.port, KV_KEY), listener)
    tokens, served = prompt(6), producer.engine.kv_transfer.server.transfers_served
    answer = prefill_hop(producer, tokens)
    pinned = len(producer.engine.kv_transfer.pins)
    assert_refused_and_computed(keyless, fresh, tokens, answer, listener)
    time.sleep(0.1)
    producer.engine.collect_transfers()
    # unasked
    assert producer.engine.kv_transfer.server.transfers_served == served
    assert len(producer.engine.kv_transfer.pins) == pinned
    producer.engine.kv_transfer.pins.collect(producer.engine.block_manager.free, now=time.monotonic() + 3600)
    keyless.engine.close()


def test_a_signed_transfer_from_the_producer_is_fetched(producer, consumer, fresh):
    tokens = prompt(7)
    answer = prefill_hop(producer, tokens)
    out = generate(consumer, tokens, answer)
    assert out.new_token_ids == generate(fresh, tokens).new_token_ids
    fetched = out.kv_transfer_params
    assert (fetched["fetch_error"], fetched["fetched_tokens"]) == (None, len(tokens) - 1)


def test_a_listed_producer_is_fetched_from_unsigned_and_no_other(model_dir, fresh, listener):
    unsigned_producer = engine(model_dir, "kv_producer")
    address = f"127.0.0.1:{unsigned_producer.engine.kv_transfer.server.port}"
    lister = engine(model_dir, "kv_consumer", kv_producers=(address,))
    tokens = prompt(8)
    answer = prefill_hop(unsigned_producer, tokens)
    assert "transfer_token" not in answer
    out = generate(lister, tokens, answer)
    assert out.new_token_ids == generate(fresh, tokens).new_token_ids
    assert (out.kv_transfer_params["fetch_error"], out.kv_transfer_params["fetched_tokens"]) == (None, len(tokens) - 1)
    assert_refused_and_computed(lister, fresh, prompt(9), redirected(answer, listener.port, None), listener)
    lister.engine.close()
    unsigned_producer.engine.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failed_fetch_answers_a_coarse_reason_and_logs_the_details(consumer, fresh, caplog):
    tokens, port = prompt(10), closed_port()
    with caplog.at_level(logging.WARNING, logger="tokenweir.engine"):
        out = generate(consumer, tokens, transfer_to(port, KV_KEY))
    assert out.new_token_ids == generate(fresh, tokens).new_token_ids
    answer = json.dumps(out.kv_transfer_params)
    assert out.kv_transfer_params["fetch_error"] == "fetch_failed"
    assert "refused" not in answer.lower() and str(port) not in answer
    assert any("ConnectionRefusedError" in r.getMessage() for r in caplog.records if r.name == "tokenweir.engine")
