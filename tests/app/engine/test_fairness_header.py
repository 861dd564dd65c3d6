"""The gateway's fairness id (`x-gateway-inference-fairness-id`) over HTTP on a tiny random Llama with a byte
tokenizer (so chat runs too): it reaches the request's sequence, a too-long one is a 400 before anything is queued,
and /metrics shows each id's service."""

import pytest

from tests.app.engine.test_server import PROMPT, make_engine, serve
from tests.support.tiny_llama import add_byte_tokenizer, make_tiny_llama
from tokenweir.common.http.fairness_id import FAIRNESS_ID_HEADER, MAX_FAIRNESS_ID_CHARS

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-fair"))
    return add_byte_tokenizer(make_tiny_llama(path, seed=5, vocab_size=260, max_position_embeddings=256))


def spy_on_fairness_ids(served) -> list:
    """The fairness id of every sequence the engine queues from now on."""
    engine = served.engine.engine
    add_request, seen = engine.add_request, []

    def spy(*args, **kwargs):
        seq = add_request(*args, **kwargs)
        seen.append(seq.fairness_id)
        return seq

    engine.add_request = spy
    return seen


async def test_the_fairness_id_reaches_the_sequence_and_its_service_is_in_metrics(model_dir):
    async with serve(make_engine(model_dir)) as served:
        seen = spy_on_fairness_ids(served)
        body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
        for headers in ({FAIRNESS_ID_HEADER: "team-a"}, {}, {FAIRNESS_ID_HEADER: ""}, {FAIRNESS_ID_HEADER: "t" * 128}):
            r = await served.post("/v1/completions", body, headers=headers)
            assert r.status_code == 200, r.text
        r = await served.post("/v1/chat/completions", {**CHAT, "max_tokens": 1}, headers={FAIRNESS_ID_HEADER: "team-b"})
        assert r.status_code == 200, r.text
        assert seen == ["team-a", None, None, "t" * MAX_FAIRNESS_ID_CHARS, "team-b"]  # an empty one is none

        values = await served.metrics()

        def series(name: str, fid: str) -> float:
            return values[f'tokenweir:{name}{{fairness_id="{fid}",model_name="{served.model}"}}']

        assert series("fairness_weighted_tokens_total", "team-a") == len(PROMPT) + 2 * 3  # output weight 2
        assert series("fairness_weighted_tokens_total", "(none)") == 2 * (len(PROMPT) + 2 * 3)
        assert series("fairness_weighted_tokens_total", "team-b") > 2  # its chat prompt, one output token
        assert series("fairness_virtual_counter", "team-a") >= len(PROMPT) + 2 * 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_too_long_fairness_id_is_a_400_and_nothing_runs(model_dir, path):
    async with serve(make_engine(model_dir)) as served:
        seen = spy_on_fairness_ids(served)
        body = {"prompt": PROMPT} if path == "/v1/completions" else CHAT
        headers = {FAIRNESS_ID_HEADER: "x" * (MAX_FAIRNESS_ID_CHARS + 1)}
        r = await served.post(path, {**body, "max_tokens": 2}, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "invalid_fairness_id",
            FAIRNESS_ID_HEADER,
            "invalid_request_error",
        )
        assert str(MAX_FAIRNESS_ID_CHARS) in error["message"]
        assert seen == [] and (await served.load())["num_waiting"] == 0
