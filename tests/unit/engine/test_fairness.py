"""Token fairness (engine/sched/fairness.py, VTC): the counter alone, then the scheduler ordering, preempting and
charging by it, and VTC's bound on random workloads."""

import random

import pytest

from tokenweir.engine.sched import fairness
from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.fairness import NO_ID_LABEL, OTHER_LABEL, VirtualTokenCounter
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.scheduler import Scheduler
from tokenweir.engine.sched.sequence import Sequence

EOS = 2

# --- the counter ------------------------------------------------------------------------------------------------------


def test_service_is_prompt_tokens_plus_weighted_output_tokens():
    vtc = VirtualTokenCounter()  # output weight 2, as in the paper's experiments
    vtc.join("r1", "a")
    vtc.charge("a", prompt_tokens=10, output_tokens=3)
    assert vtc.counter("a") == 16 and vtc.served == {"a": 16}
    light = VirtualTokenCounter(output_weight=1.0)
    light.charge("a", prompt_tokens=10, output_tokens=3)
    assert light.counter("a") == 13


def test_an_id_that_becomes_backlogged_is_lifted_to_the_least_backlogged_counter():
    vtc = VirtualTokenCounter()
    vtc.join("a1", "a")
    vtc.charge("a", prompt_tokens=100)
    vtc.join("b1", "b")
    assert vtc.counter("b") == 100  # not 0: b banks nothing for the time it was not here
    vtc.join("c1", "c")
    vtc.charge("b", prompt_tokens=50)
    vtc.leave("a1")
    vtc.join("d1", "d")
    assert vtc.counter("d") == 100  # min(b 150, c 100); a, gone, does not count
    vtc.leave("b1")
    vtc.charge("c", prompt_tokens=20)
    vtc.join("b2", "b")
    assert vtc.counter("b") == 150  # back ahead of the floor (120): it keeps what it had, no reset


def test_with_nobody_backlogged_a_newcomer_starts_from_the_last_id_to_leave():
    vtc = VirtualTokenCounter()
    vtc.join("a1", "a")
    vtc.charge("a", prompt_tokens=1000)
    vtc.leave("a1")
    vtc.join("b1", "b")
    assert vtc.counter("b") == 1000  # else a, back, would wait until b had caught up 1000 tokens
    vtc.join("a2", "a")
    assert vtc.counter("a") == 1000


def test_membership_is_per_sequence_and_idempotent():
    vtc = VirtualTokenCounter()
    vtc.join("s1", "a")
    vtc.join("s1", "a")  # a preempted sequence queued again
    vtc.join("s2", "a")
    assert vtc.backlog == {"a": 2} and not vtc.contended
    vtc.join("s3", None)  # the id-less group is an id of its own
    assert vtc.contended
    vtc.leave("s1")
    vtc.leave("s1")
    vtc.leave("unknown")
    assert vtc.backlog == {"a": 1, None: 1}


def test_metrics_labels_are_bounded():
    vtc = VirtualTokenCounter(max_labels=2)
    for i, fid in enumerate(["t1", "t2", "t3", "t4", None]):
        vtc.join(f"s{i}", fid)
        vtc.charge(fid, prompt_tokens=10 * (i + 1))
    shares = {share.label: (share.served, share.counter) for share in vtc.shares()}
    # served: what each was charged; the counter: that, from the floor each was lifted to when it came (t1's 10)
    assert shares == {
        NO_ID_LABEL: (50, 10 + 50),
        "t1": (10, 10),
        "t2": (20, 10 + 20),
        OTHER_LABEL: (30 + 40, 10 + 40),  # summed; the gauge: the greatest counter among them
    }
    vtc.join("s9", "t5")
    vtc.charge("t5", prompt_tokens=1)
    assert {share.label for share in vtc.shares()} == set(shares)  # still under "(other)"
    spoof = VirtualTokenCounter()
    spoof.charge(NO_ID_LABEL, prompt_tokens=1)  # a tenant named like the id-less group's label is not counted as it
    assert [share.label for share in spoof.shares()] == [OTHER_LABEL]


def test_idle_counters_are_forgotten_past_the_bound(monkeypatch):
    monkeypatch.setattr(fairness, "MAX_IDLE_COUNTERS", 3)
    vtc = VirtualTokenCounter(max_labels=0)
    vtc.join("keep", "busy")
    for i in range(20):
        vtc.join(f"s{i}", f"t{i}")
        vtc.charge(f"t{i}", prompt_tokens=i)  # lifted to busy's 0, then ahead of it by i
        vtc.leave(f"s{i}")
    assert len(vtc.counters) <= 3 + 2 + 1  # the bound, the backlogged and labelled ids, and the last to leave
    assert vtc.counters["t19"] == 19  # the highest idle ones are the ones kept


# --- the scheduler's hooks --------------------------------------------------------------------------------------------


def test_each_prompt_token_is_charged_once_and_cached_or_recomputed_ones_not_at_all():
    vtc = VirtualTokenCounter()
    seq = Sequence("s", list(range(10, 20)), SamplingParams(max_tokens=4))
    seq.fairness_id = "a"
    vtc.join_seq(seq)
    seq.num_computed_tokens = 4  # a prefix-cache hit
    vtc.reserve_seq(seq, 4)
    assert vtc.counter("a") == 4  # reserved while the schedule goes on
    vtc.charge_computed([(seq, 4)])
    assert vtc.counters["a"] == 4 and vtc.counter("a") == 4  # the reservation became the charge
    seq.num_computed_tokens = 0  # preempted: recomputed from the start
    vtc.charge_computed([(seq, 10)])
    assert vtc.counters["a"] == 6  # only the 2 never computed before
    seq.num_computed_tokens = 10
    seq.draft_token_ids = [5, 6]
    vtc.charge_computed([(seq, 3)])  # a decode checking two drafts: output positions
    seq.num_new_tokens = 2
    vtc.charge_sampled([seq])
    assert vtc.counters["a"] == 6 + 2 * 2


# --- the scheduler ----------------------------------------------------------------------------------------------------


def request(rid: str, length: int, arrival: float, fid: str | None, max_tokens: int = 4) -> Sequence:
    base = 20 * int(rid[1:]) + (100 if rid[0] == "l" else 0)  # a prompt of its own: no prefix-cache hits
    seq = Sequence(rid, list(range(base, base + length)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    seq.arrival_time, seq.fairness_id = arrival, fid
    return seq


def make_scheduler(num_blocks: int, max_num_batched_tokens: int) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, 4),
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=64,
        eos_token_ids={EOS},
    )


def step(scheduler: Scheduler):
    batch = scheduler.schedule()
    due = {seq.request_id for seq, n in batch.scheduled() if seq.num_computed_tokens + n == seq.num_tokens}
    scheduler.update(batch, {rid: [7] for rid in due})
    return batch


@pytest.mark.parametrize("with_ids", [True, False])
def test_the_least_served_id_starts_next_within_a_priority(with_ids):
    """heavy queued three prompts before light queued two; one 8-token prompt a step fits. By arrival light waits
    for all of heavy's; by counter, once h1 has run, light's start before heavy's next ones."""
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=8)
    arrivals = [("h1", "heavy"), ("h2", "heavy"), ("h3", "heavy"), ("l1", "light"), ("l2", "light")]
    for i, (rid, fid) in enumerate(arrivals):
        scheduler.add(request(rid, 8, i / 10, fid if with_ids else None))
    started: list[str] = []
    while len(started) < len(arrivals):
        batch = step(scheduler)
        started += [seq.request_id for seq, _ in batch.prefills if seq.request_id not in started]
    assert started == (["h1", "l1", "l2", "h2", "h3"] if with_ids else ["h1", "h2", "h3", "l1", "l2"])
    if with_ids:
        assert scheduler.fairness.counters["light"] < scheduler.fairness.counters["heavy"]


@pytest.mark.parametrize("with_ids", [True, False])
def test_the_preemption_victim_is_the_latest_sequence_of_the_most_served_id(with_ids):
    """Seven 4-token blocks; heavy's two sequences and light's one grow until the blocks run out. By arrival the
    victim would be light's (the latest); by counter it is heavy's latest, h2, as heavy has been served more."""
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=64)
    for rid, length, arrival, fid in [("h1", 8, 0.0, "heavy"), ("h2", 4, 0.1, "heavy"), ("l1", 4, 0.2, "light")]:
        scheduler.add(request(rid, length, arrival, fid if with_ids else None, max_tokens=8))
    first = step(scheduler)
    assert {seq.request_id for seq, _ in first.prefills} == {"h1", "h2", "l1"}
    if with_ids:
        assert [seq.request_id for seq, _ in first.prefills] == ["h1", "l1", "h2"]  # light's goes second
    for _ in range(10):
        batch = step(scheduler)
        if batch.preempted:
            break
    else:
        raise AssertionError("the blocks never ran out")
    (victim,) = batch.preempted
    assert victim.request_id == ("h2" if with_ids else "l1")
    if with_ids:
        assert scheduler.fairness.counters["heavy"] > scheduler.fairness.counters["light"]
        assert victim.num_charged_prompt_tokens == 4  # its recompute will not be charged again


# --- VTC's bound ------------------------------------------------------------------------------------------------------


class ByArrival(VirtualTokenCounter):
    """Counts as VTC does but never reorders: today's scheduler, for the contrast."""

    contended = False  # type: ignore[assignment]


def backlogged_run(seed: int, *, rates: tuple[int, int], num_blocks: int, max_prompt: int, max_output: int,
                   fair: bool = True, late: int = 0, steps: int = 300) -> tuple[float, float]:  # fmt: skip
    """Two ids, f and g, kept backlogged (each has a waiting request at every step; g from step `late`), sending
    up to `rates` requests a step of random lengths, on a pool of `num_blocks` 4-token blocks with chunked prefill
    and preemption. Returns the largest |W_f(t1, t2) - W_g(t1, t2)| over every interval from g's first step on,
    and VTC's 2 U with U = w_p * L_input + w_q * M (L_input the longest prompt, M the pool's tokens: the most
    output tokens requests can hold at once)."""
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
    if not fair:
        scheduler.fairness = ByArrival()
    vtc, count, diffs = scheduler.fairness, 0, []
    for t in range(steps):
        for fid, rate in zip(("f", "g"), rates, strict=True):
            if fid == "g" and t < late:
                continue
            backlogged = any(seq.fairness_id == fid for seq in scheduler.waiting)
            for _ in range(rng.randint(0 if backlogged else 1, max(rate, 1))):
                count += 1
                prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, max_prompt))]
                seq = Sequence(f"{fid}{count}", prompt, SamplingParams(max_tokens=rng.randint(1, max_output)))
                seq.arrival_time, seq.fairness_id = t + count / 1e6, fid
                scheduler.add(seq)
        step(scheduler)
        if t >= late:
            diffs.append(vtc.served.get("f", 0.0) - vtc.served.get("g", 0.0))
    bound = 2 * (vtc.prompt_weight * max_prompt + vtc.output_weight * num_blocks * 4)
    return max(diffs) - min(diffs), bound


WORKLOADS = [
    {"rates": (3, 1), "num_blocks": 16, "max_prompt": 16, "max_output": 16},
    {"rates": (1, 1), "num_blocks": 8, "max_prompt": 24, "max_output": 8},
    {"rates": (5, 1), "num_blocks": 32, "max_prompt": 8, "max_output": 32},
]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("workload", range(len(WORKLOADS)))
def test_two_backlogged_ids_are_served_within_vtcs_bound(seed, workload):
    """|W_f(t1, t2) - W_g(t1, t2)| <= 2 U for two ids backlogged over [t1, t2) (Sheng et al., OSDI'24), on random
    arrivals and lengths, whatever share of the requests each sends."""
    spread, bound = backlogged_run(seed, **WORKLOADS[workload])
    assert spread <= bound


@pytest.mark.parametrize("seed", range(4))
def test_a_late_id_is_served_within_the_bound_from_its_arrival(seed):
    """g arrives after f was served alone for a while: lifted to f's counter, it gets its share from then on, no
    more (unlifted, it would take every step until it had caught up what f was served alone)."""
    spread, bound = backlogged_run(seed, **WORKLOADS[0], late=150)
    assert spread <= bound


def test_by_arrival_the_heavier_sender_takes_more_than_the_bound():
    """The check can fail: without the counter's order, the id sending three times the requests gets about three
    times the service, and the gap grows without bound."""
    spread, bound = backlogged_run(0, **WORKLOADS[0], fair=False)
    assert spread > 3 * bound
