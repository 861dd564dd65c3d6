"""What GET /load tells routers about the prefix cache: block size, cached blocks, and the hashes evicted since a
poller's last look, in the hash chain the gateway computes itself (common/text/prefix_hash.py)."""

import subprocess
import sys

from tests.app.engine.test_server import serve
from tokenweir.common.text.prefix_hash import block_hashes, probe
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.sched.stats import PrefixCacheLog

TOKENS = list(range(100, 150))


def test_block_hashes_are_stable_across_processes():
    code = (
        "from tokenweir.common.text.prefix_hash import block_hashes as b, probe;"
        "print(b(list(range(100, 150)), 16), probe(16))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("]")
    assert out[0] + "]" == str(block_hashes(TOKENS, 16))
    assert int(out[1]) == probe(16)
    assert len(block_hashes(TOKENS, 16)) == 3 and len(block_hashes(TOKENS, 16, max_blocks=2)) == 2


def test_block_manager_keys_its_cache_by_the_shared_chain_and_logs_evictions():
    bm = BlockManager(num_blocks=4, block_size=16)
    a = Sequence("a", TOKENS, SamplingParams(max_tokens=1))
    assert bm.allocate_slots(a, a.num_tokens)
    assert a.block_hashes == block_hashes(TOKENS, 16)
    assert bm.log.num_cached_blocks == 3
    bm.free(a)
    seq0, _, _ = bm.log.since(None)
    b = Sequence("b", list(range(500, 564)), SamplingParams(max_tokens=1))  # 4 blocks: evicts all of a's
    assert bm.allocate_slots(b, b.num_tokens)
    seq, evicted, complete = bm.log.since(seq0)
    assert complete and seq == seq0 + 3 and sorted(evicted) == sorted(block_hashes(TOKENS, 16))
    assert bm.log.num_cached_blocks == 4
    assert bm.log.since(seq) == (seq, [], True)


def test_log_tells_a_poller_that_fell_behind():
    log = PrefixCacheLog(capacity=3)
    for h in range(10):
        log.cached()
        log.evicted(h)
    assert log.since(5) == (10, [7, 8, 9], False)  # 6 was dropped from the ring
    assert log.since(7) == (10, [7, 8, 9], True)
    assert log.since(7, limit=2) == (10, [8, 9], False)
    assert log.since(12) == (10, [], False)  # a sequence from another log
    assert log.num_cached_blocks == 0


async def test_load_reports_prefix_cache_and_evictions(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=8, num_threads=1, max_model_len=128))
    async with serve(engine) as s:
        first = await s.load()
        assert first["block_size"] == 16 and first["num_cached_blocks"] == 0
        assert first["prefix_hash_probe"] == probe(16) and first["evicted_hashes"] == []
        since, epoch = first["evicted_seq"], first["evicted_epoch"]
        r = await s.post("/v1/completions", {"prompt": TOKENS, "max_tokens": 1})
        assert r.status_code == 200
        load = await s.wait_idle()
        assert load["num_cached_blocks"] == 3 and load["evicted_hashes"] == []
        other_prompt = [(7 * i) % 256 for i in range(127)]  # + 1 generated: all 8 blocks, evicting every cached one
        r = await s.post("/v1/completions", {"prompt": other_prompt, "max_tokens": 1})
        assert r.status_code == 200
        await s.wait_idle()
        load = (await s.client.get("/load", params={"since": since, "epoch": epoch})).json()
        assert set(block_hashes(TOKENS, 16)) <= set(load["evicted_hashes"]) and load["evicted_complete"]
        again = (await s.client.get("/load", params={"since": load["evicted_seq"], "epoch": epoch})).json()
        assert again["evicted_hashes"] == [] and again["evicted_complete"]
        other = (await s.client.get("/load", params={"since": 0, "epoch": "another-process"})).json()
        assert other["evicted_hashes"] == [] and other["evicted_complete"] is False
