"""Unit tests of ``tandem.client``."""
