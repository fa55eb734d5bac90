"""Unit tests of ``tandem.backends.models``."""
