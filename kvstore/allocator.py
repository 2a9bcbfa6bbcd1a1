"""Page allocator with reference counts.

A page is held by its owners: each running request whose page table lists it, and the prefix cache if the
page is in the radix tree. `ref[p]` counts those owners. A page returns to the free list exactly when its
count drops to zero; nobody else frees pages. Bookkeeping is plain Python so it is testable without a device.
"""

from __future__ import annotations


class OutOfPages(Exception):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        # Page 0 is reserved (padding); it is never free and never allocated.
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low page ids first

    @property
    def total(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
        return pages

    def retain(self, pages) -> None:
        for p in pages:
            assert self.ref[p] > 0, f"retain of free page {p}"
            self.ref[p] += 1

    def release(self, pages) -> None:
        for p in pages:
            r = self.ref[p] - 1
            assert r >= 0, f"double release of page {p}"
            self.ref[p] = r
            if r == 0:
                self._free.append(p)

    def check(self, expected_refs: dict[int, int]) -> None:
        """Raise if the counts differ from the owners the caller sees, or a page is lost or doubly free."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        if 0 in free:
            raise AssertionError("the reserved page 0 is on the free list")
        for p in range(1, self.num_pages):
            want = expected_refs.get(p, 0)
            if self.ref[p] != want:
                raise AssertionError(f"page {p}: ref {self.ref[p]}, owners {want}")
            if (want == 0) != (p in free):
                raise AssertionError(f"page {p}: ref {want} but {'on' if p in free else 'off'} the free list")
