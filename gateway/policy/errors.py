"""Why a policy call refused; the admin API maps these to HTTP errors in one place."""

from __future__ import annotations


class PolicyError(Exception):
    """Base of every error the cache policy raises."""


class UnknownEntry(PolicyError, KeyError):
    def __init__(self, key: str):
        super().__init__(f"no cache entry with key {key!r}")
        self.key = key

    def __str__(self) -> str:
        return str(self.args[0])


class EntryPinned(PolicyError):
    def __init__(self, key: str):
        super().__init__(f"cache entry {key!r} is pinned; unpin it first or force the removal")
        self.key = key


class InvalidPriors(PolicyError, ValueError):
    """Preset priors that cannot be used; ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidEntry(PolicyError, ValueError):
    """An entry the policy cannot track (bad key or size)."""
