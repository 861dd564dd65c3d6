"""Disaggregated prefill behind the engines' HTTP API (vLLM's shape), on a tiny random Llama: the prefill hop
(`"kv_transfer_params": {"do_remote_decode": true}`, max_tokens 1) answers where its prompt's KV waits; the decode
hop, given that answer, fetches it and streams the same tokens as one engine; both engines' /metrics count the
transfer, and the producer frees its pin on its own (its loop is idle). A hop an engine does not take, or an answer
missing its keys, is a 400 naming kv_transfer_params."""

import asyncio

import pytest

from tests.app.engine.test_server import greedy_reference, make_engine, serve, sse_events
from tests.support.kv_transfer import KV_KEY
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.engine.config import KVTransferConfig

PROMPT = [(7 * i + 3) % 250 + 2 for i in range(70)]  # 70 tokens: 4 full blocks and a part to fetch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-disagg")), seed=3, max_position_embeddings=512)


def role(kv_role: str) -> dict:
    return {"kv_transfer": KVTransferConfig(kv_role=kv_role, transfer_key=KV_KEY)}


async def test_prefill_hop_then_decode_hop_stream_one_engines_tokens(model_dir):
    expected = greedy_reference(model_dir, PROMPT, 24)
    async with (
        serve(make_engine(model_dir, **role("kv_producer"))) as producer,
        serve(make_engine(model_dir, **role("kv_consumer"))) as consumer,
    ):
        body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = await producer.post(
            "/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert r.status_code == 200, r.text
        answer = r.json()["kv_transfer_params"]
        assert answer["do_remote_prefill"] is True and answer["num_tokens"] == len(PROMPT)
        assert r.json()["choices"][0]["token_ids"] == expected[:1]
        assert (await producer.metrics())["tokenweir:kv_transfer_pinned_blocks"] == 5

        decode = {**body, "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
        r = await consumer.post("/v1/completions", {**decode, "kv_transfer_params": answer})
        assert r.status_code == 200, r.text
        events = [e for e in sse_events(r.text) if e != "[DONE]"]
        assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == expected
        assert events[-1]["usage"]["prompt_tokens"] == len(PROMPT)
        block_bytes = consumer.engine.engine.kv_transfer.layout.block_bytes
        fetched = events[-1]["kv_transfer_params"]  # the usage chunk says what the hop fetched, for the router
        assert fetched["remote_engine_id"] == answer["remote_engine_id"] and fetched["fetch_error"] is None
        assert (fetched["fetched_tokens"], fetched["fetched_bytes"]) == (len(PROMPT) - 1, 5 * block_bytes)
        assert fetched["fetch_ms"] > 0

        metrics = await consumer.metrics()
        assert metrics["tokenweir:kv_transfer_fetches_total"] == 1
        assert metrics["tokenweir:kv_transfer_fetch_failures_total"] == 0
        assert metrics["tokenweir:kv_transfer_received_bytes_total"] == 5 * block_bytes  # 69 tokens: 5 blocks

        for _ in range(100):  # the producer's loop frees the pin once the consumer's confirmation arrives
            metrics = await producer.metrics()
            if metrics["tokenweir:kv_transfer_pinned_blocks"] == 0:
                break
            await asyncio.sleep(0.02)
        assert metrics["tokenweir:kv_transfer_pinned_blocks"] == 0
        assert metrics["tokenweir:kv_transfer_served_total"] == 1
        assert metrics["tokenweir:kv_transfer_sent_bytes_total"] == 5 * block_bytes
        load = (await producer.client.get("/load")).json()
        assert load["num_free_blocks"] == load["num_total_blocks"]


async def test_a_hop_the_engine_does_not_take_is_a_400(model_dir):
    async with serve(make_engine(model_dir, **role("kv_consumer"))) as consumer:
        body = {"prompt": PROMPT, "max_tokens": 1}
        for params, code in [
            ({"do_remote_decode": True}, "kv_transfer_unsupported"),
            ({"do_remote_prefill": True, "remote_port": 80}, "invalid_kv_transfer_params"),
        ]:
            r = await consumer.post("/v1/completions", {**body, "kv_transfer_params": params})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["code"], error["param"], error["type"]) == (
                code,
                "kv_transfer_params",
                "invalid_request_error",
            )
