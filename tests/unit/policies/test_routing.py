"""The routing scorer (pure): prefix affinity, bounded load, dead instances, forgotten prefixes, and the plain
strategies."""

import pytest

from tokenweir.common.text.prefix_hash import block_hashes
from tokenweir.gateway.upstream.prefix_index import PrefixIndex
from tokenweir.policies.routing import Candidate, RouteParams, rank

PARAMS = RouteParams()
NAMES = ("e0", "e1", "e2", "e3")


def prompt(team: int, question: int) -> list[int]:
    """A team's long shared system prompt (8 blocks), then its own question (1 block)."""
    return [team * 1000 + i for i in range(128)] + [question] * 16


def candidates(idx: PrefixIndex, hashes: list[int], in_flight: dict | None = None, **state) -> list[Candidate]:
    hits = idx.match(hashes)
    in_flight = in_flight or {}
    return [Candidate(n, in_flight=in_flight.get(n, 0), hit_blocks=hits.get(n, 0), **state.get(n, {})) for n in NAMES]


def route(idx: PrefixIndex, tokens: list[int], in_flight: dict | None = None, **state):
    hashes = block_hashes(tokens, 16)
    order, why = rank(candidates(idx, hashes, in_flight, **state), PARAMS, hashes)
    idx.record(order[0], hashes)
    return order, why


def test_a_teams_requests_stick_to_the_instance_holding_its_prefix():
    idx = PrefixIndex()
    first, why = route(idx, prompt(1, 0))
    assert why.reason == "prefix_home" and why.hit_blocks == 0
    home = first[0]
    load = {n: 0 for n in NAMES}
    for q in range(1, 6):
        load[home] = 1  # its previous request still in flight: the cached prefix outweighs it
        order, why = route(idx, prompt(1, q), load)
        assert order[0] == home and why.reason == "prefix_hit" and why.hit_blocks == 8
        assert sorted(order) == sorted(NAMES)
    # a new team's prefix gets its own stable home, the same in another (fresh) replica
    other, _ = route(idx, prompt(2, 0))
    again, _ = route(PrefixIndex(), prompt(2, 0))
    assert other[0] == again[0]


def test_bounded_load_spills_to_the_next_best():
    idx = PrefixIndex()
    (home, *_), _ = route(idx, prompt(1, 0))
    busy = {n: 1 for n in NAMES} | {home: 6}  # far above the mean
    order, why = route(idx, prompt(1, 1), busy)
    assert order[0] != home and why.reason == "prefix_spill"
    spill = order[0]
    # the spill target now holds the prefix too and takes the team while the home is overloaded ...
    order, why = route(idx, prompt(1, 2), busy | {spill: 2})
    assert order[0] == spill and why.reason == "prefix_hit"
    # ... and a long engine queue also counts as overloaded
    order, why = route(idx, prompt(1, 3), {}, **{home: {"waiting": 20}, spill: {"waiting": 20}})
    assert order[0] not in (home, spill) and why.reason == "prefix_spill"


def test_a_dead_instance_is_skipped():
    idx = PrefixIndex()
    (home, *_), _ = route(idx, prompt(1, 0))
    order, why = route(idx, prompt(1, 1), **{home: {"available": False}})
    assert home not in order and len(order) == 3 and why.reason == "prefix_home"
    order, why = rank([Candidate(n, available=False) for n in NAMES], PARAMS, block_hashes(prompt(1, 2), 16))
    assert order == [] and why.reason == "none_available"


def test_a_forgotten_prefix_no_longer_attracts():
    idx = PrefixIndex()
    (home, *_), _ = route(idx, prompt(1, 0))
    route(idx, prompt(1, 1), {home: 9})  # spilled: two holders now
    hashes = block_hashes(prompt(1, 2), 16)
    assert len(idx.match(hashes)) == 2
    for name in list(idx.match(hashes)):
        idx.forget(name, hashes)  # evicted (reported on /load)
    busy_home = {n: 0 for n in NAMES} | {home: 1}
    order, why = rank(candidates(idx, hashes, busy_home), PARAMS, hashes)
    assert why.hit_blocks == 0 and why.reason == "prefix_home"


def test_least_loaded_and_without_token_ids():
    cands = [Candidate("a", in_flight=3), Candidate("b", running=2), Candidate("c", in_flight=1)]
    order, why = rank(cands, RouteParams(strategy="least_loaded"), [123])
    assert order == ["c", "b", "a"] and why.reason == "least_loaded"
    order, why = rank(cands, PARAMS, None)  # prefix strategy, but no hashes (no tokenizer, short prompt)
    assert order == ["c", "b", "a"] and why.reason == "least_loaded" and why.strategy == "prefix"


def test_round_robin_takes_turns_among_the_available():
    cands = [Candidate("a"), Candidate("b", available=False), Candidate("c", in_flight=50)]
    params = RouteParams(strategy="round_robin")
    firsts = [rank(cands, params, None, turn=t)[0][0] for t in range(4)]
    assert firsts == ["a", "c", "a", "c"]
    assert rank(cands, params, None, turn=1)[0] == ["c", "a"]


def test_external_members_take_no_prefix_affinity():
    cands = [Candidate("ext", prefix_capable=False), Candidate("eng", in_flight=1)]
    order, why = rank(cands, PARAMS, [1, 2, 3])
    assert order == ["eng", "ext"] and why.reason == "prefix_home"


def test_bad_params_are_refused():
    with pytest.raises(ValueError, match="route"):
        RouteParams(strategy="random")
    with pytest.raises(ValueError):
        RouteParams(load_epsilon=-1)


def test_our_requests_in_the_engines_queue_count_once():
    """The engine's queue (its /load) holds our in-flight requests: 3 of ours running there are a load of 3, not 6, so
    a 3:1 split of four requests stays under the bound and the team stays where its prefix is cached."""
    idx = PrefixIndex()
    (home, *_), _ = route(idx, prompt(1, 0))
    other = next(n for n in NAMES[:2] if n != home)
    cands = [
        Candidate(home, in_flight=3, running=3, hit_blocks=8),
        Candidate(other, in_flight=1, running=1),
    ]
    order, why = rank(cands, RouteParams(), block_hashes(prompt(1, 1), 16))
    assert order[0] == home and why.reason == "prefix_hit"
    # least loaded too: b's 2 running are the 2 we sent it; a has 3 of ours its last /load did not see yet
    assert rank([Candidate("a", in_flight=3), Candidate("b", in_flight=2, running=2)], PARAMS)[0] == ["b", "a"]


def test_rendezvous_homes_split_evenly_even_for_keys_that_differ_little():
    """Home keys of system parts that share most of their tokens: each of two instances wins about half of them
    (a tuple's hash of key and name gave one instance every key of such a family)."""
    from collections import Counter

    from tokenweir.policies.routing import home_weight

    keys = [hash(tuple([1, 2, 3, *range(40), i])) for i in range(400)]
    wins = Counter(max(("engine-0", "engine-1"), key=lambda n, k=k: (home_weight(k, n), n)) for k in keys)
    assert 160 <= wins["engine-0"] <= 240, wins
