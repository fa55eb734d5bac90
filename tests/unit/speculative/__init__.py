"""Unit tests of ``tandem.backends.speculative``."""
