"""The store's one exception tree.

Lower-library errors (OSError from the shm directory, lmdb.Error) are mapped to these in the tier that raised them.
A damaged entry is not an error for callers: reads return None and the tier counts it.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises."""


class ConfigError(StoreError, ValueError):
    """A StoreConfig field or a REVISIT_STORE_* variable has a bad value."""


class InvalidKeyError(StoreError, ValueError):
    """A key is not a 64-character lowercase hex string."""


class EntryFormatError(StoreError, ValueError):
    """Arrays or bytes handed to the store do not make a well-formed entry."""


class InvalidReadError(StoreError, ValueError):
    """A sparse read asks for tokens or layers the entry does not have."""


class EntryPinnedError(StoreError):
    """remove() of a pinned entry without force=True."""


class StoreFullError(StoreError):
    """A tier cannot take the entry: capacity reached, device full, or the LMDB map cannot grow."""


class StoreClosedError(StoreError):
    """The store was used after close()."""


class UnknownTierError(StoreError, KeyError):
    """A tiered operation named a tier that the composition does not have."""


class DamagedEntryError(StoreError):
    """Internal: a checksum, magic or length check failed. Never escapes a read; reads return None instead."""
