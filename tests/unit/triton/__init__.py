"""Unit tests of ``tandem.backends.triton``."""
