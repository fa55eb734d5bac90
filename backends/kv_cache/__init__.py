"""Paged KV memory and its bookkeeping: the pool, the page allocators, page tables.
Names load on first use (``pages`` is torch-free)."""
from ..lazy import lazy_exports

_EXPORTS = {"KVAllocator": ".allocator", "OutOfPages": ".allocator", "PageAllocator": ".allocator",
            "CachingKVAllocator": ".prefix_cache", "CachingAllocator": ".prefix_cache",
            "KVPagePool": ".page_pool", "page_shape": ".page_pool", "KV_LAYOUTS": ".pages",
            "pages_needed": ".pages", "last_page_len": ".pages", "PageTable": ".page_table",
            "build_page_table": ".page_table"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
