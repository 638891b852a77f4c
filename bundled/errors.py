"""The exception the bundled-model builders raise."""

from __future__ import annotations


class BuildError(Exception):
    """A bundled model could not be built into the cache."""
