"""Unit tests of ``tandem.backends.engine``."""
