"""Host bookkeeping of the paged KV cache's page pool: which pages are free and which hold a
shared prompt prefix.

Pages are allocated as tokens arrive (memory follows the tokens held). Nothing is reserved ahead:
the engine admits a request when its prompt fits, and when the pool runs dry mid-decode it
preempts its youngest request (infer/engine.py), which returns its pages and is recomputed later.

Prefix reuse: a full page of prompt tokens is keyed by every token up to its end (a chain of
page-sized token tuples), so two prompts share a page only when they agree on everything before
it. Shared pages are counted by reference; when no request holds a cached page it stays cached
(a later request with the same system prompt reuses it) until the pool needs it (least recently
used first). Page 0 is never handed out: unused page-table entries point at it.
"""

import collections
from collections.abc import Sequence

PrefixKey = tuple


class PagePool:
    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 2:
            raise ValueError(
                f"a page pool needs at least 2 pages (page 0 is a scratch page), got {n_pages}"
            )
        self.n_pages, self.page_size = n_pages, page_size
        self.free = list(range(n_pages - 1, 0, -1))  # pop() hands out page 1 first
        self.refs: dict[int, int] = {}
        self.cached: dict[PrefixKey, int] = {}
        self.key_of: dict[int, PrefixKey] = {}
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU cache

    @property
    def usable(self) -> int:
        """Pages that exist for requests (all but the scratch page)."""
        return self.n_pages - 1

    @property
    def in_use(self) -> int:
        """Pages held by running requests."""
        return len(self.refs)

    def available(self) -> int:
        """Pages that can be handed out now: free, or cached and held by nobody."""
        return len(self.free) + len(self.idle)

    def allocate(self) -> int | None:
        """A fresh page (evicting the least recently used idle prefix if none is free), or None
        when every page is held."""
        if self.free:
            page = self.free.pop()
        elif self.idle:
            page, _ = self.idle.popitem(last=False)
            del self.cached[self.key_of.pop(page)]
        else:
            return None
        self.refs[page] = 1
        return page

    def prefix_keys(self, tokens: Sequence[int], *, model: int = -1) -> list[PrefixKey]:
        """The keys of the full pages of `tokens`, in order, as computed by `model` (a LoRA
        adapter's index, -1 the base: another adapter's keys and values differ)."""
        keys, key, size = [], (model,), self.page_size
        for start in range(0, len(tokens) - size + 1, size):
            key = (key, tuple(tokens[start : start + size]))
            keys.append(key)
        return keys

    def lookup(self, key: PrefixKey) -> int | None:
        """The cached page holding the prefix `key`, now also held by the caller; or None."""
        page = self.cached.get(key)
        if page is None:
            return None
        if page in self.idle:
            del self.idle[page]
            self.refs[page] = 1
        else:
            self.refs[page] += 1
        return page

    def share(self, key: PrefixKey, page: int) -> None:
        """Offer a page the caller filled with the full prefix `key` to later requests."""
        if key not in self.cached and page not in self.key_of:
            self.cached[key], self.key_of[page] = page, key

    def release(self, pages: Sequence[int]) -> None:
        """The caller is done with `pages`: a cached page becomes idle (still reusable), any
        other page goes back to the free list once nobody holds it."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page]:
                continue
            del self.refs[page]
            if page in self.key_of:
                self.idle[page] = None
            else:
                self.free.append(page)
