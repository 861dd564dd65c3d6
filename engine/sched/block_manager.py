"""Paged KV-cache bookkeeping: a fixed pool of blocks, per-sequence block tables, ref counts, and a prefix cache.

Prefix cache: every full block is keyed by chain(parent_hash, its tokens) (common/text/prefix_hash.py: the gateway's
router computes the same chain), so a key names the whole prefix up to and including that block; the first block's
parent is the sequence's `hash_root`, drawn from its cache_salt, so a salted prompt shares blocks only within its
salt (fetched blocks too: a decode hop's are registered by its own chain). A hit is confirmed by comparing tokens (a
hash collision must never serve wrong K/V). Blocks whose ref count drops to zero stay in the cache but sit on the
free list in LRU order, so they are reused by new requests until the space is needed, then evicted oldest first.
Evictions go to `log` (engine/sched/stats.py PrefixCacheLog), which GET /load serves to routers.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenweir.common.text.prefix_hash import chain
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.sched.stats import PrefixCacheLog


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # first = evict first
        self.cached_blocks: dict[int, int] = {}  # prefix hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up, once per request (see record_prefix_query)
        self.prefix_cache_hits = 0  # of those, tokens found
        self.log = PrefixCacheLog()  # cached-block count and evicted hashes, for GET /load (thread-safe)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (evictable)."""
        return sum(1 for b in self.free_blocks if self.blocks[b].hash is not None)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix; never the whole sequence, as the last token must be computed."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = seq.hash_root
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain(parent, tokens)
            block_id = self.cached_blocks.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def record_prefix_query(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one request's lookup. Not done in find_cached_prefix: a waiting request is looked up again every
        step it finds no room, and the scheduler knows which lookup is the request's first scheduling."""
        if not self.enable_prefix_caching:
            return  # no cache, no queries
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_cached_tokens

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_prefix: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make the block table cover `num_new_tokens` more tokens (after any cached prefix), and room for
        `num_lookahead_tokens` draft tokens after them (never registered in the prefix cache: a draft may be
        refused). False if out of blocks, with nothing changed."""
        cached_prefix = cached_prefix or []
        assert not cached_prefix or not seq.block_table, "a cached prefix is only taken by a fresh sequence"
        total = seq.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        assert total <= seq.num_tokens
        num_new_blocks = self.blocks_needed(total + num_lookahead_tokens) - len(seq.block_table) - len(cached_prefix)
        if not self._fits(num_new_blocks, cached_prefix):
            return False
        for block_id in cached_prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            assert block.hash is not None  # a block in cached_blocks keeps its hash
            seq.block_hashes.append(block.hash)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        self._register_full_blocks(seq, total)
        return True

    def allocate_for_transfer(self, seq: Sequence, cached_prefix: list[int], num_tokens: int) -> bool:
        """Take a fresh sequence's cached prefix, and blocks to cover `num_tokens` tokens past it whose K/V another
        engine sends. Those are left out of the prefix cache until their K/V has arrived (the next allocate_slots
        registers them). False if out of blocks, with nothing changed."""
        assert not seq.block_table, "a transfer fills a fresh sequence"
        num_new_blocks = self.blocks_needed(num_tokens) - len(cached_prefix)
        if not self._fits(num_new_blocks, cached_prefix):
            return False
        assert self.allocate_slots(seq, 0, cached_prefix)  # just checked: the prefix fits
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def _fits(self, num_new_blocks: int, cached_prefix: list[int]) -> bool:
        """Whether the free list holds `num_new_blocks` fresh blocks besides the cached ones to revive."""
        revived = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        return max(num_new_blocks, 0) + revived <= self.num_free_blocks

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None and self.cached_blocks.get(block.hash) == block_id:
            del self.cached_blocks[block.hash]  # evict the least recently used cached prefix
            self.log.evicted(block.hash)
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        # Registered at schedule time: this step writes their K/V before any attention reads it (store precedes
        # attention in every layer), so a request scheduled in the same step may already share them.
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain(parent, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tokens
            if h not in self.cached_blocks:
                self.cached_blocks[h] = block.block_id
                self.log.cached()
            seq.block_hashes.append(h)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens (they held only the K/V of refused drafts)."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None, "a draft-only block is private and unregistered"
            block.ref_count = 0
            self.free_blocks[block.block_id] = None
            self.free_blocks.move_to_end(block.block_id, last=False)  # holds nothing reusable: reuse it first

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so the LRU evicts a sequence's suffix before the prefix others are likelier to share.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None or self.cached_blocks.get(block.hash) != block_id:
                    block.hash, block.token_ids = None, ()
                    self.free_blocks.move_to_end(block_id, last=False)  # holds nothing reusable: reuse it first
        seq.block_table = []
        seq.block_hashes = []
