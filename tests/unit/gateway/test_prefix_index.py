"""The gateway's prefix index: leading-run matches, forgetting, and its bound."""

from tokenweir.common.text.prefix_hash import block_hashes
from tokenweir.gateway.upstream.prefix_index import PrefixIndex


def test_match_counts_the_leading_run_per_instance():
    idx = PrefixIndex()
    team = block_hashes(list(range(64)), 16)  # 4 blocks
    idx.record("a", team)
    idx.record("b", team[:2])
    assert idx.match(team) == {"a": 4, "b": 2}
    other = block_hashes(list(range(32)) + [999] * 32, 16)  # shares the first 2 blocks only
    assert idx.match(other) == {"a": 2, "b": 2}
    assert idx.match(block_hashes([7] * 64, 16)) == {}
    assert idx.match([]) == {}


def test_a_gap_ends_the_run():
    idx = PrefixIndex()
    h = block_hashes(list(range(64)), 16)
    idx.record("a", [h[0], h[2], h[3]])
    assert idx.match(h) == {"a": 1}


def test_forget_and_forget_instance():
    idx = PrefixIndex()
    h = block_hashes(list(range(64)), 16)
    idx.record("a", h)
    idx.record("b", h)
    idx.forget("a", h[1:])
    assert idx.match(h) == {"a": 1, "b": 4}
    idx.forget_instance("b")
    assert idx.match(h) == {"a": 1}
    idx.forget("a", h[:1])
    assert idx.match(h) == {} and len(idx) == 0


def test_bounded_lru_drops_the_least_recently_recorded():
    idx = PrefixIndex(max_entries=4)
    old = block_hashes(list(range(32)), 16)
    new = block_hashes(list(range(100, 164)), 16)
    idx.record("a", old)
    idx.record("a", new)
    assert len(idx) == 4
    assert idx.match(old) == {} and idx.match(new) == {"a": 4}
    idx.record("a", new[:1])  # touched: now the most recent
    idx.record("b", old[:1])
    assert idx.match(new[:1]) == {"a": 1} and idx.match(new) == {"a": 1}  # new[1] was dropped
