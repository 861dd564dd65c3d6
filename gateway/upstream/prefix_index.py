"""Where each prompt prefix is probably cached: a bounded, approximate index `block hash -> instances that recently
served it`, one per pool in each gateway replica (not shared: each replica learns from its own dispatches).

Approximate both ways: an instance may have evicted a block the index still lists (the poller forgets what /load
reports evicted, one poll late), and another replica's dispatches are not in it. A wrong guess costs only a cache
miss. Bounded: at most `max_entries` hashes, the least recently recorded dropped first (about 200 bytes an entry
with one holder, so the default 100k is ~20 MB per pool at worst).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class PrefixIndex:
    def __init__(self, max_entries: int = 100_000) -> None:
        assert max_entries > 0
        self.max_entries = max_entries
        self._holders: OrderedDict[int, set[str]] = OrderedDict()  # first = least recently recorded

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, instance: str, hashes: Iterable[int]) -> None:
        """`instance` was sent a prompt with these block hashes: it will hold them once it has prefilled."""
        holders = self._holders
        for h in hashes:
            names = holders.get(h)
            if names is None:
                holders[h] = {instance}
            else:
                names.add(instance)
                holders.move_to_end(h)
        while len(holders) > self.max_entries:
            holders.popitem(last=False)

    def forget(self, instance: str, hashes: Iterable[int]) -> None:
        """`instance` evicted these blocks."""
        holders = self._holders
        for h in hashes:
            names = holders.get(h)
            if names is not None:
                names.discard(instance)
                if not names:
                    del holders[h]

    def forget_instance(self, instance: str) -> None:
        """`instance` lost its cache (restarted) or left the pool."""
        for h in [h for h, names in self._holders.items() if instance in names]:
            self.forget(instance, (h,))

    def match(self, hashes: list[int]) -> dict[str, int]:
        """Instance -> how many leading blocks of `hashes` it holds (instances holding none are left out)."""
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        matched = dict.fromkeys(first, 1)
        alive = set(first)
        for i, h in enumerate(hashes[1:], start=2):
            names = self._holders.get(h)
            alive = alive & names if names else set()
            if not alive:
                break
            for name in alive:
                matched[name] = i
        return matched
