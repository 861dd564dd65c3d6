"""An n-gram cache learned across requests (llama.cpp's lookup decoding with a dynamic cache): for every n-gram (n in
[prompt_lookup_min, prompt_lookup_max]) of the outputs of finished requests, how often each token followed it. A new
request's drafts then follow the most frequent continuations of its last tokens, longest n-gram first, one token at a
time. It wins where requests answer alike (the same JSON shape, the same boilerplate) and prompt lookup finds nothing
in the request itself. Bounded: past `capacity` n-grams, the least recently seen is forgotten.

Learned per `scope` (a request's cache_salt: the gateway sets one per team): a request drafts only from the outputs
of requests with the same salt, as its prefix cache is. Otherwise one tenant could learn another's outputs from
which of its own guesses are accepted (a step that accepts drafts comes sooner).
"""

from __future__ import annotations

from collections import OrderedDict


class NgramCache:
    def __init__(self, n_min: int, n_max: int, capacity: int, min_count: int = 1) -> None:
        assert 1 <= n_min <= n_max and capacity >= 1 and min_count >= 1
        self.n_min, self.n_max, self.capacity, self.min_count = n_min, n_max, capacity, min_count
        # (scope, n-gram) -> {next token: count}
        self._next: OrderedDict[tuple[str | None, tuple[int, ...]], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def learn(self, tokens: list[int], scope: str | None = None) -> None:
        """Count every (n-gram, next token) of `tokens`, for drafts of the same `scope`."""
        table = self._next
        for end in range(self.n_min, len(tokens)):
            following = tokens[end]
            for n in range(self.n_min, min(self.n_max, end) + 1):
                key = (scope, tuple(tokens[end - n : end]))
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {}
                else:
                    table.move_to_end(key)
                counts[following] = counts.get(following, 0) + 1
        while len(table) > self.capacity:
            table.popitem(last=False)

    def draft(self, context: list[int], k: int, scope: str | None = None) -> list[int]:
        """Up to k tokens continuing `context`: each the most frequent follower of the longest n-gram learned in
        `scope` ending there (seen at least min_count times); stops where no n-gram is known."""
        tail = list(context[-self.n_max :])
        drafts: list[int] = []
        while len(drafts) < k:
            for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
                counts = self._next.get((scope, tuple(tail[len(tail) - n :])))
                if counts:
                    token, count = max(counts.items(), key=lambda item: item[1])
                    if count >= self.min_count:
                        break
            else:
                return drafts
            drafts.append(token)
            tail.append(token)
        return drafts
