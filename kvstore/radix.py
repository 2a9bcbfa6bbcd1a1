"""Radix-tree prefix cache at page granularity.

Each edge holds a run of whole pages: its key is the tokens those pages hold (a multiple of page_size) and
`pages` the page ids. Only full pages enter the tree, so a match is always a whole number of pages and the
matched pages can be shared read-only: nobody writes into a full page again.

Ownership: the tree holds one reference on every page it lists (see PageAllocator). A page is evictable when
the tree is its only owner (ref == 1). Eviction takes least recently used leaves first, trimming a leaf from
its tail so that pages still shared by running requests stay.
"""

from __future__ import annotations

import heapq
import itertools

from kvstore.allocator import PageAllocator


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "_Node | None"):
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.last_access = 0


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.root = _Node((), [], None)
        self._clock = itertools.count(1)
        self.num_pages = 0
        # Counters for metrics: tokens asked for in matches, and tokens found in the cache.
        self.query_tokens = 0
        self.hit_tokens = 0

    def _first_page(self, tokens, start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def _matched_pages(self, node: _Node, tokens, start: int) -> int:
        """How many of `node`'s pages equal the tokens from `start` on."""
        ps = self.page_size
        n = 0
        for i in range(len(node.pages)):
            a = start + i * ps
            if a + ps > len(tokens) or tuple(tokens[a:a + ps]) != node.key[i * ps:(i + 1) * ps]:
                break
            n += 1
        return n

    def match(self, tokens, record: bool = True) -> list[int]:
        """Pages caching the longest whole-page prefix of `tokens`. The caller must retain them to use them."""
        node, pos, pages = self.root, 0, []
        now = next(self._clock)
        while pos + self.page_size <= len(tokens):
            child = node.children.get(self._first_page(tokens, pos))
            if child is None:
                break
            k = self._matched_pages(child, tokens, pos)
            child.last_access = now
            pages.extend(child.pages[:k])
            pos += k * self.page_size
            if k < len(child.pages):
                break
            node = child
        if record:
            self.query_tokens += len(tokens)
            self.hit_tokens += len(pages) * self.page_size
        return pages

    def insert(self, tokens, pages: list[int]) -> list[int]:
        """Cache `pages` as holding `tokens` (len(tokens) == len(pages) * page_size).

        Returns the tree's pages for the whole prefix. Where the tree already had a prefix, its pages are
        returned in place of the caller's (the caller should switch to them and release its duplicates);
        pages new to the tree gain the tree's reference.
        """
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "only whole pages are cached"
        node, pos, out = self.root, 0, []
        now = next(self._clock)
        while pos < len(tokens):
            first = self._first_page(tokens, pos)
            child = node.children.get(first)
            if child is None:
                rest = pages[pos // ps:]
                self.allocator.retain(rest)
                self.num_pages += len(rest)
                new = _Node(tuple(tokens[pos:]), list(rest), node)
                new.last_access = now
                node.children[first] = new
                out.extend(rest)
                break
            k = self._matched_pages(child, tokens, pos)
            if k < len(child.pages):
                self._split(child, k)
            child.last_access = now
            out.extend(child.pages)
            pos += k * ps
            node = child
        return out

    def _split(self, node: _Node, k: int) -> None:
        """Cut `node` after its first k pages; the rest becomes its only child."""
        ps = self.page_size
        tail = _Node(node.key[k * ps:], node.pages[k:], node)
        tail.children = node.children
        for c in tail.children.values():
            c.parent = tail
        tail.last_access = node.last_access
        node.key, node.pages = node.key[:k * ps], node.pages[:k]
        node.children = {tail.key[:ps]: tail}

    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                yield n

    def evictable_pages(self) -> int:
        ref = self.allocator.ref
        return sum(1 for n in self._nodes() for p in n.pages if ref[p] == 1)

    def evict(self, want: int) -> int:
        """Free up to `want` pages held only by the tree, least recently used leaves first."""
        ref = self.allocator.ref
        heap = [self._eviction_key(n) for n in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < want:
            _, _, node = heapq.heappop(heap)
            n_tail = 0
            while n_tail < len(node.pages) and ref[node.pages[-1 - n_tail]] == 1:
                n_tail += 1
            n_tail = min(n_tail, want - freed)
            if n_tail == 0:
                continue
            cut = len(node.pages) - n_tail
            self.allocator.release(node.pages[cut:])
            self.num_pages -= n_tail
            freed += n_tail
            node.pages, node.key = node.pages[:cut], node.key[:cut * self.page_size]
            if not node.pages:
                parent = node.parent
                del parent.children[tuple(self._first_key(node))]
                if parent is not self.root and not parent.children:
                    heapq.heappush(heap, self._eviction_key(parent))
        return freed

    @staticmethod
    def _eviction_key(n: _Node):
        # Ties go by page id, never by memory address: the ranks of a tensor-parallel worker must evict the
        # same pages. Every leaf holds pages, and no two nodes hold the same page, so nodes never compare.
        return n.last_access, n.pages[0], n

    def _first_key(self, node: _Node):
        # A node emptied by eviction lost its key; find it by identity in its parent.
        for k, c in node.parent.children.items():
            if c is node:
                return k
        raise KeyError("node not in its parent")

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n

    def page_ids(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def reset(self) -> None:
        """Drop every cached page (used by a flush; callers make sure no request holds tree pages)."""
        for n in self._nodes():
            self.allocator.release(n.pages)
        self.root = _Node((), [], None)
        self.num_pages = 0
