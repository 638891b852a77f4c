"""The shared books' exceptions."""

from __future__ import annotations


class BooksError(Exception):
    """Base of the shared books' errors."""


class BooksUnavailable(BooksError):
    """The server holding the shared books (Redis or Valkey) did not answer."""


class BooksMismatch(BooksError):
    """This gateway's settings differ from those the shared books were made with."""
