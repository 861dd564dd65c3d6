"""An n-gram cache learned across requests (llama.cpp's lookup decoding with a dynamic cache): for every n-gram (n in
[prompt_lookup_min, prompt_lookup_max]) of the outputs of finished requests, how often each token followed it. A new
request's drafts then follow the most frequent continuations of its last tokens, longest n-gram first, one token at a
time. It wins where requests answer alike (the same JSON shape, the same boilerplate) and prompt lookup finds nothing
in the request itself. Bounded: past `capacity` n-grams, the least recently seen is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict


class NgramCache:
    def __init__(self, n_min: int, n_max: int, capacity: int, min_count: int = 1) -> None:
        assert 1 <= n_min <= n_max and capacity >= 1 and min_count >= 1
        self.n_min, self.n_max, self.capacity, self.min_count = n_min, n_max, capacity, min_count
        self._next: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()  # n-gram -> {next token: count}

    def __len__(self) -> int:
        return len(self._next)

    def learn(self, tokens: list[int]) -> None:
        """Count every (n-gram, next token) of `tokens`."""
        table = self._next
        for end in range(self.n_min, len(tokens)):
            following = tokens[end]
            for n in range(self.n_min, min(self.n_max, end) + 1):
                key = tuple(tokens[end - n : end])
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {}
                else:
                    table.move_to_end(key)
                counts[following] = counts.get(following, 0) + 1
        while len(table) > self.capacity:
            table.popitem(last=False)

    def draft(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens continuing `context`: each the most frequent follower of the longest known n-gram ending
        there (seen at least min_count times); stops where no n-gram is known."""
        tail = list(context[-self.n_max :])
        drafts: list[int] = []
        while len(drafts) < k:
            for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
                counts = self._next.get(tuple(tail[len(tail) - n :]))
                if counts:
                    token, count = max(counts.items(), key=lambda item: item[1])
                    if count >= self.min_count:
                        break
            else:
                return drafts
            drafts.append(token)
            tail.append(token)
        return drafts
