"""What tests do to a shared pool that the product never needs."""
from __future__ import annotations

from tandem.rdma import SharedKVPool


def cache_hold(pool: SharedKVPool, pages) -> None:
    """The cache's owner marks ``pages`` held for a sequence before publishing them, so a
    test can check holds page by page (decode's allocator holds a page from the moment
    it publishes it, and takes cached pages with ``cache_match``)."""
    with pool._locked():
        if pool._owning_cache():
            pool._cache.hold(pages)
