"""Page allocator and radix prefix cache, on their own (no model, no device)."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVPool, PageAllocator, RadixCache
from kvstore.allocator import OutOfPages

PS = 4


def tokens(*pages):
    """Token list from page labels: page label k -> [k*10, k*10+1, k*10+2, k*10+3]."""
    return [k * 10 + i for k in pages for i in range(PS)]


def test_allocator_counts_owners_and_frees_at_zero():
    a = PageAllocator(5)
    assert a.total == 4 and a.num_free == 4
    pages = a.alloc(3)
    assert 0 not in pages and a.num_free == 1
    a.retain(pages[:1])
    a.release(pages)
    assert a.num_free == 3  # pages[0] still has an owner
    a.check({pages[0]: 1})
    with pytest.raises(OutOfPages):
        a.alloc(4)
    a.release(pages[:1])
    a.check({})
    with pytest.raises(AssertionError):
        a.release(pages[:1])


def test_radix_matches_whole_pages_and_shares_them():
    a = PageAllocator(20)
    cache = RadixCache(a, PS)
    p = a.alloc(3)
    assert cache.insert(tokens(1, 2, 3), p) == p
    assert cache.match(tokens(1, 2, 3)) == p
    assert cache.match(tokens(1, 2, 9)) == p[:2]
    # A partial page never matches: only whole pages are shared.
    assert cache.match(tokens(1, 2) + [30, 31]) == p[:2]
    assert cache.match(tokens(7)) == []
    assert cache.hit_tokens == 3 * PS + 2 * PS + 2 * PS
    a.release(p)  # the request is done; the tree keeps the pages
    a.check({x: 1 for x in p})


def test_radix_insert_returns_existing_pages_for_known_prefix():
    a = PageAllocator(20)
    cache = RadixCache(a, PS)
    first = a.alloc(2)
    cache.insert(tokens(1, 2), first)
    dup = a.alloc(3)  # a second request computed the same prefix on its own, then one more page
    got = cache.insert(tokens(1, 2, 5), dup)
    assert got == first + dup[2:]
    # Splitting a node keeps both branches matchable.
    other = a.alloc(1)
    cache.insert(tokens(1, 6), [first[0], other[0]])
    assert cache.match(tokens(1, 6)) == [first[0], other[0]]
    assert cache.match(tokens(1, 2, 5)) == first + dup[2:]


def test_radix_evicts_least_recently_used_unshared_pages_only():
    a = PageAllocator(20)
    cache = RadixCache(a, PS)
    old, new = a.alloc(2), a.alloc(2)
    cache.insert(tokens(1, 2), old)
    cache.insert(tokens(3, 4), new)
    a.release(old + new)
    cache.match(tokens(3, 4))  # touch: `old` is now least recently used
    held = cache.match(tokens(3))
    a.retain(held)  # a running request shares new[0]
    assert cache.evict(3) == 3
    assert cache.match(tokens(1, 2)) == []
    assert cache.match(tokens(3, 4)) == [new[0]]  # the shared page stayed
    assert cache.evict(10) == 0  # nothing else is evictable while shared
    a.release(held)
    assert cache.evict(10) == 1
    a.check({})
    assert cache.num_pages == 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pool_layout_writes_tokens_into_their_page_slots(layout):
    pool = KVPool(num_pages=4, page_size=PS, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32,
                  device="cpu", layout=layout)
    assert pool.max_total_num_tokens == 3 * PS
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    index = pool.slot_index(torch.tensor([2, 2, 3]), torch.tensor([0, 3, 1]))
    pool.write(1, index, k, v)
    layer = pool.layer(1)
    if layout == "NHD":  # [page, kv, slot, head, dim]
        assert torch.equal(layer[2, 0, 3], k[1]) and torch.equal(layer[3, 1, 1], v[2])
    else:  # [page, kv, head, slot, dim]: head 1 of token 1 at (page 2, slot 3)
        assert torch.equal(layer[2, 0, 1, 3], k[1, 1]) and torch.equal(layer[3, 1, :, 1], v[2])
    assert torch.equal(pool.read(1, index), torch.stack([k, v], dim=1))
    assert pool.layer(0).abs().sum() == 0 and layer[0].abs().sum() == 0  # the padding page stays zero
    # One page of one layer is one contiguous block in both layouts (transfers move pages as blocks).
    assert pool.layer(1)[2].is_contiguous() and pool.layer(1)[2].numel() == 2 * PS * 2 * 8
