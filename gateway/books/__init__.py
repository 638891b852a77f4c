"""Books shared by gateway replicas (README, "Scaling out"): one ordered log of book events in Redis or Valkey.

- :mod:`gateway.books.shared`: ``SharedBooks``, the policy whose changes go through the log, and its follower.
- :mod:`gateway.books.log`: ``BookLog``, the log, its snapshots and the settings check.
- :mod:`gateway.books.features`: ``SharedFeatureStore``, the match index's features in the same server.
- :mod:`gateway.books.errors`: its exceptions.

Without ``REVISIT_BOOKS_URL`` a gateway keeps its books to itself (gateway/policy, gateway/cache.py).
"""

from gateway.books.errors import BooksError, BooksMismatch, BooksUnavailable
from gateway.books.features import SharedFeatureStore
from gateway.books.log import BookLog
from gateway.books.shared import SharedBooks, settings_fingerprint

__all__ = ["BookLog", "BooksError", "BooksMismatch", "BooksUnavailable", "SharedBooks", "SharedFeatureStore",
           "settings_fingerprint"]
