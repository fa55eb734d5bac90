"""Unit tests of ``tandem.backends.kv_cache``."""
