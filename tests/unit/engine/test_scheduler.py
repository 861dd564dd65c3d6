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
    return scheduler.update(batch, {rid: [token] for rid, token in tokens.items() if rid in due})


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


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    scheduler = make_scheduler()
    scheduler.chunked_prefill = False
    scheduler.max_num_batched_tokens = 12
    first = Sequence("first", list(range(10, 18)), SamplingParams(max_tokens=4))  # 8 tokens
    second = Sequence("second", list(range(30, 40)), SamplingParams(max_tokens=4))  # 10: not in the 4 left
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.prefills == [(first, 8)] and second in scheduler.waiting
    scheduler.update(batch, {"first": [11]})
    batch = scheduler.schedule()  # first's decode takes 1 of 12: second's 10 fit whole
    assert batch.decodes == [first] and batch.prefills == [(second, 10)]


def test_a_long_prompt_over_the_threshold_leaves_room_for_a_short_one_behind_it():
    scheduler = make_scheduler(num_blocks=32)
    long = Sequence("long", list(range(10, 110)), SamplingParams(max_tokens=4))  # 100 tokens
    scheduler.add(long)
    assert scheduler.schedule().prefills == [(long, 64)]  # no threshold: the whole budget
    scheduler = make_scheduler(num_blocks=32)
    scheduler.long_prefill_token_threshold = 16
    scheduler.add(long := Sequence("long", list(range(10, 110)), SamplingParams(max_tokens=4)))
    batch = scheduler.schedule()
    assert batch.prefills == [(long, 16)]
    scheduler.update(batch, {})
    short = Sequence("short", list(range(200, 206)), SamplingParams(max_tokens=4))
    scheduler.add(short)
    batch = scheduler.schedule()  # the long one's next chunk, and the short one's whole prompt beside it
    assert batch.prefills == [(long, 16), (short, 6)]


def test_drafts_are_checked_accepted_ones_kept_refused_ones_given_back():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    bm = scheduler.block_manager
    seq = Sequence("s", [5, 6, 7], SamplingParams(max_tokens=20))
    scheduler.add(seq)
    run_step(scheduler, {"s": 8})  # prompt computed, first token 8 (position 3, not computed yet)
    seq.draft_token_ids = [9, 10, 11, 12]
    batch = scheduler.schedule()
    assert batch.verifies == [seq] and list(batch.scheduled()) == [(seq, 5)] and batch.num_tokens == 5
    assert len(seq.block_table) == 2  # positions 3..7 need a second block
    hashes_before = list(seq.block_hashes)
    stepped = scheduler.update(batch, {"s": [9, 10, 42]})  # drafts 9, 10 accepted, 11 refused, 42 in its place
    assert stepped == [seq] and seq.num_new_tokens == 3 and seq.draft_token_ids == []
    assert seq.output_token_ids == [8, 9, 10, 42] and seq.num_computed_tokens == 6  # 8, 9, 10's K/V kept
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 14
    assert seq.block_hashes == hashes_before  # no draft entered the prefix cache
    seq.draft_token_ids = [21, 22, 23, 24]
    batch = scheduler.schedule()
    assert len(seq.block_table) == 3  # room for positions 6..10
    scheduler.update(batch, {"s": [99]})  # every draft refused
    assert seq.output_token_ids[-1] == 99 and seq.num_computed_tokens == 7
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 14, "the refused drafts' block is given back"


def test_drafts_stop_at_a_stop_token_and_at_max_tokens():
    scheduler = make_scheduler()
    stopping = Sequence("stop", [5, 6], SamplingParams(max_tokens=20))
    capped = Sequence("cap", [5, 6, 7], SamplingParams(max_tokens=3))
    for seq in (stopping, capped):
        scheduler.add(seq)
    run_step(scheduler, {"stop": 8, "cap": 8})
    stopping.draft_token_ids = [9, EOS, 10]
    capped.draft_token_ids = [9, 10]
    batch = scheduler.schedule()
    scheduler.update(batch, {"stop": [9, EOS, 10, 11], "cap": [9, 10, 12]})
    assert stopping.output_token_ids == [8, 9, EOS] and stopping.finish_reason == "stop"
    assert capped.output_token_ids == [8, 9, 10] and capped.finish_reason == "length"
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_drafts_are_dropped_when_the_budget_or_the_blocks_run_short():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    scheduler.max_num_batched_tokens = 3
    seq = Sequence("s", [5, 6, 7], SamplingParams(max_tokens=20))
    scheduler.add(seq)
    run_step(scheduler, {"s": 8})
    seq.draft_token_ids = [11, 12, 13, 14]
    batch = scheduler.schedule()
    assert batch.verifies == [seq] and seq.draft_token_ids == [11, 12]  # the budget of 3: the token and 2 drafts
    scheduler.update(batch, {"s": [11, 12, 13]})
    seq.draft_token_ids = [14, 15]  # positions 6..8: a third block, and there are two
    batch = scheduler.schedule()
    assert batch.decodes == [seq] and batch.verifies == [] and seq.draft_token_ids == []


def start_order(scheduler: Scheduler, seqs: list[Sequence]) -> list[str]:
    """The order in which the sequences' prompts first get a chunk, stepping until all have one."""
    for seq in seqs:
        scheduler.add(seq)
    started: list[str] = []
    while len(started) < len(seqs):
        batch = scheduler.schedule()
        started += [seq.request_id for seq, _ in batch.prefills if seq.request_id not in started]
        scheduler.update(batch, {})
    return started


def prompt(rid: str, length: int, arrival: float, priority: int = 0) -> Sequence:
    return Sequence(rid, list(range(3, 3 + length)), SamplingParams(max_tokens=4), priority, arrival)


def burst(scheduler_kw: dict) -> list[str]:
    scheduler = Scheduler(
        BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, eos_token_ids={EOS},
        **scheduler_kw,
    )  # fmt: skip
    seqs = [prompt("a30", 30, 0.0), prompt("b5", 5, 0.001), prompt("c12", 12, 0.002), prompt("d8", 8, 0.003)]
    return start_order(scheduler, seqs)


def test_fcfs_starts_prompts_by_arrival_and_shortest_prompt_a_bursts_short_prompts_first():
    assert burst({}) == ["a30", "b5", "c12", "d8"]
    assert burst({"shortest_prompt_first": True}) == ["b5", "d8", "c12", "a30"]


def test_shortest_prompt_passes_a_long_prompt_over_only_within_its_own_compute_time():
    def order(short_arrival: float) -> list[str]:
        scheduler = Scheduler(
            BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64, eos_token_ids={EOS},
            shortest_prompt_first=True,
        )  # fmt: skip
        scheduler.tokens_per_s = 100.0  # the long prompt's 40 tokens: 0.4 s
        return start_order(scheduler, [prompt("long", 40, 0.0), prompt("short", 4, short_arrival)])

    assert order(0.05) == ["short", "long"]  # done at 0.09 s against 0.4 s
    assert order(0.5) == ["long", "short"]  # arrived after the long prompt would have been done: it waits


def test_shortest_prompt_keeps_priorities_first_and_learns_the_engines_pace():
    scheduler = Scheduler(
        BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, eos_token_ids={EOS},
        shortest_prompt_first=True,
    )  # fmt: skip
    urgent, short = prompt("urgent-long", 30, 0.01, priority=-1), prompt("short", 4, 0.0)
    assert start_order(scheduler, [short, urgent]) == ["urgent-long", "short"]
    before = scheduler.tokens_per_s
    scheduler.observe_step(512, 0.1)  # 5120 tokens/s
    assert before < scheduler.tokens_per_s < 5120
