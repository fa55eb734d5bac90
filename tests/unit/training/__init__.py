"""Unit tests of ``tandem.backends.training``."""
