"""Unit tests of ``tandem.backends.attention``."""
