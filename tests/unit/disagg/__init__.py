"""Unit tests of ``tandem.backends.disagg``."""
