"""Paged KV storage: the device pool, the page allocator and the radix-tree prefix cache."""

from kvstore.allocator import PageAllocator
from kvstore.pool import KVPool, kv_bytes_per_token
from kvstore.radix import RadixCache

__all__ = ["KVPool", "PageAllocator", "RadixCache", "kv_bytes_per_token"]
