"""The engine's prefix cache under vLLM's cache_salt, over HTTP on a tiny random Llama: a prompt sent again with
another salt (or none) reuses nothing, and with the same salt reuses its full blocks."""

import pytest

from tests.app.engine.test_server import make_engine, serve
from tests.support.tiny_llama import make_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-salt")), seed=3, max_position_embeddings=256)


async def cached(served, prompt: list[int], salt: str | None) -> int:
    body = {"prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt is not None else {})
    r = await served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_prompt_sent_with_another_salt_reuses_nothing_and_with_the_same_salt_its_blocks(model_dir):
    prompt = [(13 * i + 7) % 250 + 2 for i in range(70)]  # 4 full 16-token blocks, then 6 more
    async with serve(make_engine(model_dir)) as served:
        assert await cached(served, prompt, "team-a") == 0
        assert await cached(served, prompt, "team-b") == 0  # another tenant: a miss, as for a prompt never sent
        assert await cached(served, prompt, None) == 0
        assert await cached(served, prompt, "team-a") == 64
        assert await cached(served, prompt, "team-b") == 64
        assert await cached(served, prompt, None) == 64


async def test_an_empty_salt_is_refused_naming_the_field(model_dir):
    async with serve(make_engine(model_dir)) as served:
        r = await served.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": ""})
        assert r.status_code == 400 and "cache_salt" in r.text, r.text
