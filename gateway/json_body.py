"""A request body's JSON, parsed within bounds: how many objects, arrays and values it holds (counted in the raw
bytes before parsing, at C speed) and how deep it nests, read as strictly as orjson (which encodes it for the
worker) would. Everything after this reads a body that is small enough to walk and shallow enough to recurse into.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import InvalidRequest, PayloadTooLarge

# The most objects and arrays a body may hold. Each costs ~60-100 bytes once parsed, so 16 MB of [{},{},...] took
# ~500 MB and half a second of parsing (holding the GIL, so stalling the event loop); 100,000 is ~10 MB at most, and
# far more than any real request holds (every message, part and image_url is one). Counted before parsing by the
# brackets in the raw bytes, at C speed: brackets inside strings count too (base64 holds none; code or JSON pasted
# into a message does), so the count can only err towards refusing.
MAX_JSON_CONTAINERS = 100_000
# The most values a body may hold, counted as its containers and its commas (every value in an array or an object
# but the first is after one). Small values cost far more parsed than sent: 16 MB of [0.1,0.1,...] parsed to 124 MiB
# (a float object and a pointer for each 4 bytes), of ["ab","ab",...] to 181 MiB, and a 64 MiB body four times that.
# 2**18 values are 15 MiB at most parsed, and twice a 128K-token context's worth of token ids. Counted before parsing
# by the commas in the raw bytes, at C speed, so commas inside strings count too: a text needs more tokens than it
# has commas (a comma is a token, or part of one) to hold this many, and no worker's context is that long.
MAX_JSON_VALUES = 1 << 18
# The deepest nesting a body may have (the body itself is depth 1). A real request nests to ~6 (body > messages >
# message > content > part > image_url), tools' JSON schemas to 10-20. The parser goes deeper, but the body is
# later encoded for the worker by orjson.dumps, which stops at 255 (that was a 500), and copied and digested by
# gateway/intake.py (copy.deepcopy, json.dumps, both recursive): 32 keeps all of them safe. The walk that checks it
# visits each value once, bounded by MAX_JSON_CONTAINERS and the body's size.
MAX_JSON_DEPTH = 32
# The integers orjson (which encodes the body for the worker) holds as integers; the parser, like orjson's, reads
# one outside them as a float.
_INT_RANGE = range(-(1 << 63), 1 << 64)
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_json(raw: bytes | bytearray, unparsed: Callable[[bytes | bytearray], None] | None = None) -> Any:
    """Parse a request body, within MAX_JSON_CONTAINERS objects and arrays, MAX_JSON_VALUES values and MAX_JSON_DEPTH
    levels, as strictly as orjson (which encodes it for the worker) would: UTF-8, no NaN or Infinity, no number that
    overflows a double, no lone surrogate; an integer past 64 bits read as a float.

    A body of LONG_STRINGS_BODY bytes or more has its long base64 data URLs cut out of the bytes first (see
    :class:`_LongStrings`): run on a thread, no step here then holds the GIL, and so stalls the event loop, for more
    than a few milliseconds, where one parse of a 28 MB body held it for 50 ms. Those that are the ``url`` of a part
    stay in the body's bytes, as :class:`CutURL` values (not a string of the whole URL: making one of 27 MB held the
    GIL 13-15 ms, mostly page faults); any other is put back as the string it is.

    A bytearray is consumed: emptied once decoded to text (unless CutURLs keep it), so that a large body is held
    twice at the most while it is parsed (its text, then what it parses to), not three times. orjson held the body,
    a copy of its own and the result at once: 48 MiB of text peaked at 144 MiB, and at 96 MiB here, in about the
    same time (the stdlib's C scanner; ~90 ms either way). A parse error keeps nothing of the text (the parser's
    exception holds the whole document). What is left to parse of a body up to ORJSON_BYTES (every body but one of
    long text: a large one's data URLs are cut out) is parsed by orjson, in a quarter of the time; a body it refuses
    (an integer past 64 bits, say, or a mistake) is parsed again as above, which accepts or says why not."""
    long_strings = _LongStrings.cut(raw) if len(raw) >= LONG_STRINGS_BODY else None
    rest = long_strings.rest if long_strings is not None else raw
    containers = rest.count(b"{") + rest.count(b"[")
    if containers > MAX_JSON_CONTAINERS:
        raise PayloadTooLarge(f"request body holds {containers} JSON objects and arrays (counting the brackets in "
                              f"strings too); the limit is {MAX_JSON_CONTAINERS}", code="too_many_json_values")
    values = containers + rest.count(b",")
    if values > MAX_JSON_VALUES:
        raise PayloadTooLarge(f"request body holds about {values} JSON values (its objects, arrays and commas, "
                              f"counting commas in strings too); the limit is {MAX_JSON_VALUES}",
                              code="too_many_json_values")
    if unparsed is not None:  # what the caller refuses from the bytes alone, before they are parsed
        unparsed(raw)
    if len(rest) <= ORJSON_BYTES:
        try:
            body = orjson.loads(rest)
        except orjson.JSONDecodeError:
            pass  # the parse below says what is wrong, as precisely as ever
        else:
            if isinstance(raw, bytearray) and long_strings is None:
                raw.clear()
            _check_values(body, long_strings.strings if long_strings is not None else None)
            return body
    error = None
    try:
        text = rest.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = exc.start if long_strings is None else long_strings.in_body(exc.start)
        error = f"request body is not valid JSON: it is not UTF-8 ({exc.reason} at byte {where})"
    if error is not None:
        raise InvalidRequest(error)
    if isinstance(raw, bytearray) and long_strings is None:
        raw.clear()
    del rest
    try:
        body = json.loads(text, parse_constant=_not_a_number)
    except _NotANumber as exc:
        error = f"request body is not valid JSON: {exc}"
    except json.JSONDecodeError as exc:
        error = f"request body is not valid JSON: {exc.msg}: line {exc.lineno} column {exc.colno} (char {exc.pos})"
        if long_strings is not None:
            error = f"request body is not valid JSON: {exc.msg}"  # positions in the body with its strings cut out
    except RecursionError:
        error = "deep"
    finally:
        del text
    if error == "deep":
        raise _too_deep()
    if error is not None:
        raise InvalidRequest(error)
    _check_values(body, long_strings.strings if long_strings is not None else None)
    return body


class CutURL(str):
    """A long data URL of a parsed body, left in the body's bytes (see decode_json). As a string it is the URL's
    header and a placeholder for its base64 (``data:image/png;base64,#revisit-cut-<nonce>-<n>#``): what reads only
    the header (the scheme, the media type) reads it as it is, and the placeholder is no base64, so nothing can
    mistake it for the payload. The payload is read from the body's bytes: ``source[payload_start:end]``
    (gateway/image_fetch.py decodes it in slices; gateway/dispatch.py's UpstreamRequest puts it back in the JSON the
    worker gets, as the same bytes). Immutable, as the body's bytes are while it is kept: copies are itself."""

    __slots__ = ("source", "start", "payload_start", "end", "marker")
    source: bytes | bytearray
    start: int
    payload_start: int
    end: int
    marker: str

    def __new__(cls, source: bytes | bytearray, start: int, end: int, marker: str) -> CutURL:
        comma = source.find(b",", start, end)  # there is one: the URL holds ";base64,"
        self = super().__new__(cls, str(source[start:comma + 1], "ascii") + marker)
        self.source, self.start, self.payload_start, self.end, self.marker = source, start, comma + 1, end, marker
        return self

    def __copy__(self) -> CutURL:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> CutURL:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return str, (self.text(),)  # pickled as the URL it stands for

    @property
    def length(self) -> int:
        """Characters of the whole URL."""
        return self.end - self.start

    @property
    def padded(self) -> bool:
        """Whether whitespace surrounds the base64 (a cut string holds no whitespace but the space)."""
        source, start, end = self.source, self.payload_start, self.end
        return end > start and (source[start:start + 1] == b" " or source[end - 1:end] == b" ")

    @property
    def payload(self) -> memoryview:
        """The base64, as it lies in the body."""
        return memoryview(self.source)[self.payload_start:self.end]

    def text(self) -> str:
        """The whole URL as a string (the copy this type spares: for tests and small URLs)."""
        return str(self.source[self.start:self.end], "ascii")


def full_text(value: Any) -> Any:
    """``value`` with every CutURL in it made the whole string it stands for (what json.loads would have given)."""
    if isinstance(value, CutURL):
        return value.text()
    if isinstance(value, dict):
        return {name: full_text(item) for name, item in value.items()}
    if isinstance(value, list):
        return [full_text(item) for item in value]
    return value


LONG_STRING = 64 * 1024  # bytes of a string's content, from which it is cut out
ORJSON_BYTES = 1 << 20  # a body's bytes left to parse (its long strings cut out), up to which orjson parses them
# Bodies from this size (any that may hold a long string) have their long base64 strings cut out before they are
# parsed (see _LongStrings): a 118 KB body with one 224-px PNG parsed in 217 us whole, 66 us with it cut out.
LONG_STRINGS_BODY = LONG_STRING
_BASE64_MARK = b";base64,"
_SLICE = 1 << 20  # bytes checked per call: ~1.4 ms of holding the GIL
# What a cut string may hold: printable ASCII but the quote and the backslash (so JSON reads it as the bytes it is).
_PLAIN = bytes([0x20, 0x21, *range(0x23, 0x5C), *range(0x5D, 0x7F)])


@dataclass(frozen=True, slots=True)
class _Cut:
    """A string cut out of a body: ``source[start:end]``, and the placeholder that stands for it in ``rest``."""

    source: bytes | bytearray
    start: int
    end: int
    placeholder: str

    def text(self) -> str:
        return str(self.source[self.start:self.end], "ascii")

    def restored(self, where: object) -> str:
        """What the parsed body holds in its place: a part's ``url`` stays in the body's bytes (CutURL); any other
        string is made again."""
        return CutURL(self.source, self.start, self.end, self.placeholder) if where == "url" else self.text()


class _LongStrings:
    """A body's long data URLs (``"data:...;base64,..."``, LONG_STRING bytes or more), cut out of its bytes: ``rest``
    is the body with each replaced by a placeholder string no client can write (it holds a random nonce), and
    ``strings`` maps each placeholder to where its string lies in the body (_Cut), which _check_values puts in its
    place once the rest is parsed (a part's url as a CutURL, anything else as its string). The JSON parser reads the
    long strings as one C call over the whole body (50 ms for 28 MB, holding the GIL); here they are found with
    memchr-speed searches and checked in slices, and only what is left of the body is parsed.

    A string is cut out only when it is exactly the JSON text of itself: printable ASCII with no quote or backslash
    (so no escapes), checked here; anything else is left for the parser to read (or refuse) as before. A marker
    ``;base64,`` can only be inside a string (it is no JSON syntax), so the last quote before it, unless escaped (then
    the string began further back, and is left whole), opens the string, and the first quote after it closes it."""

    def __init__(self, rest: bytes, strings: dict[str, _Cut], spans: list[tuple[int, int]]) -> None:
        self.rest = rest
        self.strings = strings
        self._spans = spans  # (where in rest, bytes fewer than in the body) for each string cut, in order

    @classmethod
    def cut(cls, raw: bytes | bytearray) -> _LongStrings | None:
        view = memoryview(raw)
        nonce = secrets.token_hex(8)
        pieces: list[bytes | memoryview] = []
        strings: dict[str, _Cut] = {}
        spans: list[tuple[int, int]] = []
        kept = taken = 0  # the body up to ``kept`` is in pieces; bytes of rest so far
        at = 0
        while (mark := raw.find(_BASE64_MARK, at)) >= 0:
            start = raw.rfind(b'"', kept, mark) + 1  # the string's first byte (0: no quote: not a string we cut)
            end = raw.find(b'"', mark)
            if end < 0:
                break
            at = end + 1
            if start <= 0 or end - start < LONG_STRING or not raw.startswith(b"data:", start) \
                    or _escaped(raw, start - 1) or not _plain(view[start:end]):
                continue
            placeholder = f"#revisit-cut-{nonce}-{len(strings)}#"
            pieces += [view[kept:start], placeholder.encode()]
            taken += start - kept
            spans.append((taken, end - start - len(placeholder)))
            taken += len(placeholder)
            strings[placeholder] = _Cut(raw, start, end, placeholder)
            kept = end
        if not strings:
            return None
        pieces.append(view[kept:])
        return cls(b"".join(pieces), strings, spans)

    def in_body(self, at: int) -> int:
        """A position in ``rest`` as the position in the body it was cut from."""
        moved = 0
        for where, removed in self._spans:
            if where >= at:
                break
            moved += removed
        return at + moved


def _escaped(raw: bytes | bytearray, quote: int) -> bool:
    """Whether the quote at ``quote`` is escaped (an odd number of backslashes before it): a quote inside a string,
    which then began further back."""
    backslashes = 0
    while quote - backslashes > 0 and raw[quote - backslashes - 1] == 0x5C:
        backslashes += 1
    return backslashes % 2 == 1


def _plain(view: memoryview) -> bool:
    """Whether the bytes are all printable ASCII but the quote and the backslash (in slices: see _SLICE)."""
    return all(not bytes(view[at:at + _SLICE]).translate(None, _PLAIN) for at in range(0, len(view), _SLICE))


class _NotANumber(ValueError):
    pass


def _not_a_number(name: str) -> Any:
    raise _NotANumber(f"{name} is not a JSON value")


def _check_values(body: Any, cut: dict[str, _Cut] | None = None) -> None:
    """Walk the parsed body (depth first, with a stack of its own: recursing is what the depth limit spares
    everything after): its depth, and each value as orjson would have read it, and the strings ``cut`` out of it
    (_LongStrings) put back in place of their placeholders. A list is looked at by the types it holds first, at C
    speed: 16 MB of ``[0,0,...]`` (8 M values) is checked in ~0.2 s, not 1 s of a loop."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [([body], 0)]  # the body itself is at depth 1
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if type(node) is dict:
            if cut and any(name in cut for name in node):  # a long data URL as a name: renamed in place
                items = [(cut.pop(name).text() if name in cut else name, value) for name, value in node.items()]
                node.clear()
                node.update(items)
            for name in node:
                if not name.isascii() and _SURROGATE.search(name):
                    raise _lone_surrogate()
            _check_items(node, node.items(), depth, stack, cut)
            continue
        kinds = set(map(type, node))
        if kinds <= {int, bool}:  # a list of integers, as long as it may be: its ends, at C speed
            if not node or (min(node) in _INT_RANGE and max(node) in _INT_RANGE):
                continue
        elif kinds <= {float, bool, type(None)}:  # of floats: each finite, at C speed (None and 0.0 skipped)
            if all(map(math.isfinite, filter(None, node))):
                continue
        _check_items(node, enumerate(node), depth, stack, cut)


def _check_items(node: dict[str, Any] | list[Any], items: Iterable[tuple[Any, Any]], depth: int,
                 stack: list[tuple[dict[str, Any] | list[Any], int]], cut: dict[str, _Cut] | None) -> None:
    for where, value in items:
        kind = type(value)
        if kind is dict or kind is list:
            stack.append((value, depth + 1))
        elif kind is str:
            if cut and value in cut:  # a placeholder: its text is plain ASCII, nothing more to check
                node[where] = cut.pop(value).restored(where)
            elif not value.isascii() and _SURROGATE.search(value):
                raise _lone_surrogate()
        elif kind is float:
            if not math.isfinite(value):
                raise InvalidRequest("request body is not valid JSON: a number is infinity when read as a double")
        elif kind is int and value not in _INT_RANGE:
            node[where] = float(value)


def _lone_surrogate() -> InvalidRequest:
    return InvalidRequest("request body is not valid JSON: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                          "without its pair)")


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"request body nests JSON objects and arrays more than {MAX_JSON_DEPTH} deep",
                          code="json_too_deep")
