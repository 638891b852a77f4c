"""The password of the Redis or Valkey server that holds the shared books and the workers' outcomes.

Across hosts (compose.scale-out.yaml) that server takes only clients that know its password
(``requirepass``). The gateways and workers read the password from a file (``REVISIT_BOOKS_PASSWORD_FILE`` and
``REVISIT_STORE_OUTCOMES_PASSWORD_FILE``: a line of printable characters without spaces, double quotes or
backslashes, such as the 64 hex digits ``revisit keys password FILE`` writes) and hand redis-py a URL that carries it
(``redis://:PASSWORD@host:6379/0``). That URL is a :class:`RedisURL`: a ``str`` whose text is the whole URL, for
redis-py, but which shows itself (``str()``, ``repr()``, f-strings, ``%s`` in logs and error messages) with the
password masked.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

MASK = "***"
SCHEMES = ("redis://", "rediss://", "unix://")
# What a server's config line (requirepass "...") and a URL both carry unchanged once quoted.
_PASSWORD_RE = re.compile(r'^[!#-\[\]-~]{1,512}$')  # printable ASCII but space, '"' and '\'
_QUERY_SECRETS = ("password",)  # redis-py also takes the password as a query argument


class RedisPasswordError(ValueError):
    """The password file cannot be read or holds no usable password, or the URL has a password already."""


def masked(url: str) -> str:
    """``url`` with any password in it (``:PASSWORD@`` or ``?password=``) replaced by ``***``."""
    text = str.__str__(url)  # the text itself, even of a RedisURL
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:  # not a URL urllib can split (a bad port): show its scheme alone
        return text.partition("://")[0] + "://" + MASK
    netloc = parts.netloc
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(name in _QUERY_SECRETS for name, _ in pairs):
            query = urlencode([(name, MASK if name in _QUERY_SECRETS else value) for name, value in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class RedisURL(str):
    """A Redis URL that may carry a password: its text is the whole URL (what redis-py is given), but it shows
    itself with the password masked, however it is printed."""

    __slots__ = ()

    def __new__(cls, url: str = "") -> RedisURL:
        return super().__new__(cls, str.__str__(url))  # the text, not the shown form, of a RedisURL given

    @property
    def shown(self) -> str:
        return masked(self)

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return repr(self.shown)

    def __format__(self, spec: str) -> str:
        return format(self.shown, spec)

    @property
    def has_password(self) -> bool:
        try:
            parts = urlsplit(str.__str__(self))
            return parts.password is not None or any(name in _QUERY_SECRETS for name, _ in parse_qsl(parts.query))
        except ValueError:
            return False


def read_password(path: Path) -> str:
    """The password in ``path``, surrounding whitespace (a final newline) ignored. Raises RedisPasswordError naming
    the file, never its content."""
    try:
        text = Path(path).read_text(encoding="ascii").strip()
    except OSError as exc:
        raise RedisPasswordError(f"cannot read the password file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise RedisPasswordError(f"the password file {path} holds something other than ASCII text") from None
    if not _PASSWORD_RE.match(text):
        raise RedisPasswordError(
            f"the password file {path} must hold one line of 1 to 512 printable characters without spaces, double "
            "quotes or backslashes (`revisit keys password FILE` writes one)")
    return text


def with_password(url: str, password_file: Path | None) -> RedisURL:
    """``url`` with the password in ``password_file`` put in (as ``:PASSWORD@``), or as it is without one; shown
    masked either way. Raises RedisPasswordError when the file is unusable or the URL names a password too."""
    shown_url = RedisURL(url)
    if password_file is None:
        return shown_url
    if shown_url.has_password:
        raise RedisPasswordError(f"{shown_url} has a password in it, and a password file is set too: give it once")
    password = read_password(password_file)
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    user = userinfo if at else ""
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return RedisURL(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)))


def create_password(path: Path) -> None:
    """Write a new password (32 random bytes as hex) to ``path``, readable by its owner only; never overwrites."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(secrets.token_hex(32) + "\n")
