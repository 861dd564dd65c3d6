"""Fairness by weighted tokens (VTC) in the dispatch queue's scheduler: the service difference between backlogged
teams stays within VTC's bound on any arrivals and lengths, a team that was away banks nothing, and a newcomer is not
starved.

VTC (Sheng et al., OSDI'24) bounds the counters of two backlogged clients within 2U, U the most weighted tokens one
request can cost (w_p x prompt + w_q x output). The gateway charges a request's output when the request ends, so the
output of up to `capacity` requests in flight is not yet counted: the bound checked here is (2U + capacity x O) / w,
O the most weighted output one request makes, w the least weight (service is compared per unit of weight).
"""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenweir.policies.priority import StrideScheduler

W_OUT = 2  # VTC's output weight in its experiments, and the pools' default


def simulate(
    requests: dict[str, list[tuple[int, int]]], weights: dict[str, int], capacity: int, seed: int
) -> tuple[float, dict[str, int]]:
    """Every team backlogged with its (prompt, output) requests, `capacity` in flight, finishing in a random order:
    the largest service difference (per unit of weight) seen while every team still waited, and each team's
    service."""
    order = random.Random(seed)
    scheduler, queues = StrideScheduler(), {team: deque(reqs) for team, reqs in requests.items()}
    for team in queues:
        scheduler.activate(team, weights[team])
    in_flight: list[tuple[str, int]] = []
    served = dict.fromkeys(queues, 0)
    worst = 0.0
    while any(queues.values()) or in_flight:
        while len(in_flight) < capacity and (team := scheduler.peek()) is not None:
            prompt, output = queues[team].popleft()
            scheduler.served(team, prompt)
            served[team] += prompt
            if not queues[team]:
                scheduler.deactivate(team)
            in_flight.append((team, output))
        team, output = in_flight.pop(order.randrange(len(in_flight)))
        scheduler.charge(team, W_OUT * output, weights[team])
        served[team] += W_OUT * output
        if all(queues.values()):
            per_weight = [served[t] / weights[t] for t in queues]
            worst = max(worst, max(per_weight) - min(per_weight))
    return worst, served


team_requests = st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 1000)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.dictionaries(st.sampled_from("abcd"), team_requests, min_size=2, max_size=4),
    weight_list=st.lists(st.integers(1, 4), min_size=4, max_size=4),
    capacity=st.integers(1, 16),
    seed=st.integers(0, 2**32),
)
def test_backlogged_teams_stay_within_the_vtc_bound(requests, weight_list, capacity, seed):
    weights = dict(zip("abcd", weight_list, strict=True))
    most = max(p + W_OUT * o for reqs in requests.values() for p, o in reqs)
    most_output = max(W_OUT * o for reqs in requests.values() for _, o in reqs)
    least_weight = min(weights[t] for t in requests)
    worst, _ = simulate(requests, weights, capacity, seed)
    assert worst <= (2 * most + capacity * most_output) / least_weight


def test_long_requests_get_no_more_tokens_than_short_ones():
    """A team of long prompts and answers against one of short ones, both backlogged: by tokens they are served
    about equally, so the short team gets many more requests through (by requests it would get as many as the
    heavy team, and a fraction of the tokens)."""
    heavy = [(2000, 500)] * 40
    light = [(50, 20)] * 2000
    worst, served = simulate({"heavy": heavy, "light": light}, {"heavy": 1, "light": 1}, 1, 0)
    assert worst <= 2 * (2000 + W_OUT * 500)
    share = served["light"] / (served["light"] + served["heavy"])
    assert share > 0.45  # 2000 light requests cost 180k tokens, 40 heavy 120k: light got its half while both waited


def test_a_team_back_from_idle_banks_nothing_and_is_not_starved():
    s = StrideScheduler()
    s.activate("busy", 1)
    for _ in range(100):
        s.served("busy", 1000)  # 100k tokens while "idle" sent nothing
    s.activate("idle", 1)
    assert s.pass_of("idle") == s.pass_of("busy")  # lifted to the least active counter: no credit for its absence
    assert s.peek() == "busy"  # a tie goes to the first active: and then the newcomer, at once
    s.served("busy", 1000)
    assert s.peek() == "idle"


def test_output_charged_after_the_request_left_the_queue_still_counts():
    """The output of a request is known only when it ends, after its team may have left the queue: its team's
    counter still grows, and it comes back behind a team that was served less."""
    s = StrideScheduler()
    s.activate("a", 1)
    s.activate("b", 1)
    s.served("a", 10)
    s.deactivate("a")
    s.charge("a", 5000, 1)  # a's long answer ends while it has nothing queued
    s.served("b", 10)
    s.activate("a", 1)
    s.served("b", 10)
    assert s.peek() == "b"  # a's 5010 tokens against b's 20: b goes on
