from .allocator import OutOfPages, PageAllocator
from .page_pool import KV_LAYOUTS, KVPagePool, page_shape
from .page_table import PageTable, build_page_table, last_page_len, pages_needed

__all__ = ["OutOfPages", "PageAllocator", "KV_LAYOUTS", "KVPagePool", "page_shape",
           "PageTable", "build_page_table", "last_page_len", "pages_needed"]
