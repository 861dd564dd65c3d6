"""The scheduler without a model: post-step bookkeeping (`update`) and what it counts (`make_stats`)."""

from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.scheduler import Scheduler
from tokenweir.engine.sched.sequence import Sequence

EOS = 2


def make_scheduler(num_blocks: int = 16, block_size: int = 4, max_model_len: int = 64) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=max_model_len,
        eos_token_ids={EOS},
    )


def run_step(scheduler: Scheduler, tokens: dict[str, int]) -> list[Sequence]:
    """One step in which each sequence that reached the end of its tokens samples tokens[request_id]."""
    batch = scheduler.schedule()
    due = {seq.request_id for seq, n in batch.scheduled() if seq.num_computed_tokens + n == seq.num_tokens}
    return scheduler.update(batch, {rid: token for rid, token in tokens.items() if rid in due})


def test_update_advances_appends_and_finishes_on_each_stop_condition():
    scheduler = make_scheduler()
    seqs = {
        "eos": Sequence("eos", [5, 6, 7], SamplingParams(max_tokens=8)),
        "eos-ignored": Sequence("eos-ignored", [5, 6], SamplingParams(max_tokens=8, ignore_eos=True)),
        "stop-id": Sequence("stop-id", [5], SamplingParams(max_tokens=8, stop_token_ids=[9])),
        "length": Sequence("length", [5, 6, 7, 8], SamplingParams(max_tokens=2)),
    }
    for seq in seqs.values():
        scheduler.add(seq)
    stepped = run_step(scheduler, {"eos": 11, "eos-ignored": 11, "stop-id": 11, "length": 11})
    assert sorted(s.request_id for s in stepped) == sorted(seqs)  # a 1-token prompt runs as a decode: first
    assert all(s.num_computed_tokens == s.num_prompt_tokens and s.output_token_ids == [11] for s in stepped)
    assert not any(s.is_finished for s in stepped)

    stepped = run_step(scheduler, {"eos": EOS, "eos-ignored": EOS, "stop-id": 9, "length": 12})
    assert {(s.request_id, s.finish_reason, s.stop_reason) for s in stepped if s.is_finished} == {
        ("eos", "stop", EOS),
        ("stop-id", "stop", 9),
        ("length", "length", None),
    }
    assert scheduler.running == [seqs["eos-ignored"]] and seqs["eos-ignored"].output_token_ids == [11, EOS]
    assert all(s.block_table == [] for s in stepped if s.is_finished), "finished sequences free their blocks"


def test_update_stops_at_the_context_limit():
    scheduler = make_scheduler(max_model_len=6)
    seq = Sequence("long", [5, 6, 7, 8, 9], SamplingParams(max_tokens=100))
    scheduler.add(seq)
    (stepped,) = run_step(scheduler, {"long": 11})
    assert stepped.finish_reason == "length" and stepped.num_tokens == 6


def test_a_prefill_chunk_short_of_the_prompt_samples_nothing():
    scheduler = make_scheduler()
    scheduler.max_num_batched_tokens = 4
    seq = Sequence("chunked", list(range(10, 20)), SamplingParams(max_tokens=4))
    scheduler.add(seq)
    assert run_step(scheduler, {"chunked": 11}) == [] and seq.num_computed_tokens == 4
    assert run_step(scheduler, {"chunked": 11}) == [] and seq.num_computed_tokens == 8
    assert run_step(scheduler, {"chunked": 11}) == [seq] and seq.output_token_ids == [11]


def test_prefix_cache_query_counts_once_per_request():
    """A request that waits for blocks is looked up again every step; only its first scheduling counts."""
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    bm = scheduler.block_manager
    running = Sequence("running", list(range(100, 132)), SamplingParams(max_tokens=8))  # 8 of the 10 blocks
    waiting = Sequence("waiting", list(range(200, 240)), SamplingParams(max_tokens=1))  # 40 tokens: 10 blocks
    scheduler.add(running)
    run_step(scheduler, {"running": 7})
    scheduler.add(waiting)
    for _ in range(5):
        run_step(scheduler, {"running": 7})
        assert scheduler.waiting == [waiting]
    assert bm.prefix_cache_queries == running.num_prompt_tokens  # not + 5 * 40

    scheduler.finish(running, "abort")
    run_step(scheduler, {"waiting": 7})
    assert waiting.is_finished
    assert bm.prefix_cache_queries == 32 + 40
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (72, 0)
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_free_blocks) == (0, 0, 10)


def test_a_preempted_request_is_not_queried_again():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    bm = scheduler.block_manager
    low = Sequence("low", list(range(100, 107)), SamplingParams(max_tokens=8), priority=1)
    high = Sequence("high", list(range(200, 207)), SamplingParams(max_tokens=8), priority=0)
    scheduler.add(low)
    scheduler.add(high)
    for _ in range(40):
        run_step(scheduler, {"low": 7, "high": 7})
        if not scheduler.has_unfinished():
            break
    assert scheduler.num_preemptions > 0 and low.is_finished and high.is_finished
    assert bm.prefix_cache_queries == 14
