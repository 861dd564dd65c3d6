"""KV blocks never leak: unit tests of the BlockManager and a randomized engine run of finish / abort / preempt."""

import random

import pytest

from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.sequence import Sequence


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=4))


def test_allocation_covers_tokens_and_failure_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(10)))
    assert bm.allocate_slots(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    b = seq("b", list(range(100, 109)))
    assert not bm.allocate_slots(b, 9)  # needs 3, only 1 free
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == 4


def test_prefix_hit_needs_equal_tokens_and_never_covers_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(12)))
    assert bm.allocate_slots(a, 12)
    b = seq("b", list(range(12)))  # identical: the last block must still be computed
    assert len(bm.find_cached_prefix(b)) == 2
    c = seq("c", list(range(8)) + [99, 98, 97])
    assert bm.find_cached_prefix(c) == a.block_table[:2]
    d = seq("d", [0, 1, 2, 77, 4, 5, 6, 7, 8])
    assert bm.find_cached_prefix(d) == []


def test_hash_collision_is_rejected_by_the_token_check():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # as if another prefix had hashed to the same key
    assert bm.find_cached_prefix(seq("b", [1, 2, 3, 4, 5])) == []


def test_freed_prefix_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    again = seq("a2", [1, 2, 3, 4, 6])
    hits = bm.find_cached_prefix(again)
    assert len(hits) == 2
    assert bm.allocate_slots(again, 1, hits)
    assert bm.num_free_blocks == 1
    bm.free(again)
    # A request needing the whole pool evicts every cached block.
    big = seq("big", list(range(50, 58)))
    assert bm.allocate_slots(big, 8)
    assert bm.num_free_blocks == 0 and bm.cached_blocks.keys() == {b for b in bm.cached_blocks}
    assert all(bm.blocks[b].ref_count == 1 for b in big.block_table)
    bm.free(big)
    assert bm.num_free_blocks == 4


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, "every block returns to the free list"
    assert all(b.ref_count == 0 for b in bm.blocks)
    for block_id in bm.cached_blocks.values():  # what stays cached is evictable, i.e. on the free list
        assert block_id in bm.free_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_of_finish_abort_preempt_leaks_no_block(tiny_model_dir, seed):
    rng = random.Random(seed)
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir,
            num_kv_blocks=20,
            block_size=8,
            max_num_batched_tokens=48,
            max_num_seqs=6,
            quantization="none",
        )
    )
    prefixes = [[rng.randrange(3, 256) for _ in range(16)] for _ in range(3)]
    live: set[str] = set()
    for i in range(60):
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 17)] + [
                rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))
            ]
            params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randrange(1, 30), ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params, priority=rng.randrange(3))
            live.add(f"r{i}")
        if live and rng.random() < 0.2:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
    assert not live
    assert engine.scheduler.num_preemptions > 0, "the pool is small enough that this mix must preempt"
    assert_no_leak(engine)


def test_pool_exhaustion_and_back(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, num_kv_blocks=8, block_size=8, max_num_seqs=16, quantization="none")
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(6):  # each grows to 5 blocks: together 30 blocks against 8
        engine.add_request(f"x{i}", [5 + i] * 10, params)
    peak = 0
    done = 0
    while engine.has_unfinished_requests():
        done += sum(o.finished for o in engine.step())
        peak = max(peak, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
    assert done == 6 and peak == 8
    assert engine.scheduler.num_preemptions > 0
    assert_no_leak(engine)
