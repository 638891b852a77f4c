"""Long base64 data URLs cut out of a large body before it is parsed (gateway/json_body.py's _LongStrings): the body
parses to exactly what the JSON parser reads, whatever the strings hold and wherever they are, a part's url left in
the body's bytes as a CutURL that stands for it."""

from __future__ import annotations

import base64
import json
import os

import pytest

from gateway.errors import InvalidRequest
from gateway.json_body import LONG_STRING, LONG_STRINGS_BODY, CutURL, _LongStrings, decode_json, full_text

BLOB = base64.b64encode(os.urandom(LONG_STRINGS_BODY)).decode()  # a body past the size, a string past the length


def url(blob: str = BLOB, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{blob}"


def message(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def image(link: str) -> dict:
    return {"type": "image_url", "image_url": {"url": link}}


BODIES = {
    "one image": message(image(url()), {"type": "text", "text": "what is it?"}),
    "three images and text between": message(image(url()), {"type": "text", "text": "and"},
                                             image(url(BLOB[:LONG_STRING])), image(url(BLOB[::-1], "video/mp4"))),
    "a data URL as a name": {"model": "m", url(): [url()], "messages": []},
    "a short one, not cut": message(image(url(BLOB[:100])), {"type": "text", "text": "x" * LONG_STRINGS_BODY}),
    "non-ASCII after the mark": message(image(url(BLOB[:LONG_STRING] + "é" + BLOB[:LONG_STRING]))),
    "a control character": message(image(url(BLOB[:LONG_STRING] + "\n" + BLOB[:LONG_STRING]))),
    "text that mentions a mark": message({"type": "text", "text": "see ;base64, " + "y" * LONG_STRINGS_BODY}),
    "not a data URL": message({"type": "text", "text": "note;base64," + BLOB}),
    "a quoted data URL in a text": message({"type": "text", "text": 'he said "' + url() + '"'}),
    "a data URL after a quote in a text": message({"type": "text", "text": 'he said "' + url()}),
    "after an escaped backslash": message({"type": "text", "text": "a\\"}, image(url())),
}


@pytest.mark.parametrize("name", BODIES)
def test_a_large_body_parses_to_what_the_parser_reads(name: str) -> None:
    body = BODIES[name]
    for raw in (json.dumps(body).encode(), json.dumps(body, indent=1).encode()):
        assert full_text(decode_json(raw)) == json.loads(raw) == body
        assert full_text(decode_json(bytearray(raw))) == body


def urls(value) -> list:
    """Every part's url in a parsed body."""
    return [part["image_url"]["url"] for message in value["messages"] for part in message["content"]
            if isinstance(part, dict) and "image_url" in part]


def test_a_parts_long_url_stays_in_the_bodys_bytes() -> None:
    body = BODIES["three images and text between"]
    raw = bytearray(json.dumps(body).encode())
    parsed = decode_json(raw)
    cut = urls(parsed)
    assert [type(u) for u in cut] == [CutURL] * 3 and len(raw) > 0  # the body is kept: the URLs lie in it
    for url_, want in zip(cut, urls(body), strict=True):
        assert url_.source is raw and url_.text() == want and url_.length == len(want)
        assert str(url_) == want.partition(",")[0] + "," + url_.marker  # what reads the header reads it
        assert bytes(url_.payload) == want.partition(",")[2].encode()
    # Only a part's url is left so: a long data URL anywhere else is the string it is.
    named = decode_json(json.dumps(BODIES["a data URL as a name"]).encode())
    assert not any(isinstance(v, CutURL) for v in (*named, *named[url()]))


def test_only_long_data_urls_written_plainly_are_cut_out() -> None:
    raw = json.dumps(BODIES["three images and text between"]).encode()
    cut = _LongStrings.cut(raw)
    assert cut is not None and len(cut.strings) == 3 and len(cut.rest) < 2000
    assert sorted(len(string.text()) for string in cut.strings.values()) == sorted(
        len(url(b)) for b in (BLOB, BLOB[:LONG_STRING], BLOB[::-1]))
    for name in ("a short one, not cut", "non-ASCII after the mark", "a control character", "not a data URL",
                 "text that mentions a mark", "a quoted data URL in a text", "a data URL after a quote in a text"):
        assert _LongStrings.cut(json.dumps(BODIES[name]).encode()) is None, name
    after = _LongStrings.cut(json.dumps(BODIES["after an escaped backslash"]).encode())
    assert after is not None and len(after.strings) == 1  # the quote after "a\\" is a real one
    escaped = json.dumps(message(image(url()))).replace("data:image/png", "data:image\\/png").encode()
    assert _LongStrings.cut(escaped) is None and full_text(decode_json(escaped)) == message(image(url()))


def test_a_placeholder_written_by_a_client_is_its_own_text() -> None:
    """A placeholder holds a nonce drawn per body: a client that writes one gets its text back, not a string cut
    out of another body (or of its own)."""
    raw = json.dumps(BODIES["one image"]).encode()
    cut = _LongStrings.cut(raw)
    assert cut is not None
    (placeholder,) = cut.strings
    forged = message(image(url()), {"type": "text", "text": placeholder}, {"type": "text", "text": "#revisit-cut-"})
    assert full_text(decode_json(json.dumps(forged).encode())) == forged


@pytest.mark.parametrize("broken, says", [
    (b'{"model": "m", "messages": [{"content": "' + url().encode() + b'"}]', "not valid JSON"),
    (b'{"model": "m", "a": "' + url().encode() + b'", "b": NaN}', "NaN is not a JSON value"),
    (b'{"model": "m", "a": "' + url().encode() + b'", "b": "\xff"}', "it is not UTF-8"),
])
def test_a_broken_body_is_refused_as_before(broken: bytes, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidRequest, match=says) as cut:
        decode_json(broken)
    monkeypatch.setattr("gateway.json_body.LONG_STRINGS_BODY", 1 << 40)  # parsed whole, as before
    with pytest.raises(InvalidRequest, match=says) as whole:
        decode_json(broken)
    if "UTF-8" in says:  # the byte named is the body's, not the cut body's
        where = broken.index(bytes([0xFF]))
        assert str(cut.value) == str(whole.value) and f"at byte {where}" in str(cut.value)


def test_a_body_with_its_strings_cut_out_is_parsed_beside_one_copy_of_itself() -> None:
    """Less than a body parsed whole (tests/gateway/test_request_body.py): the body and what is left of it, the URL
    never copied out of it."""
    import tracemalloc

    blob = base64.b64encode(os.urandom(12 * 1024 * 1024)).decode()
    tracemalloc.start()
    try:
        raw = bytearray(json.dumps(message(image(url(blob)))).encode())
        size = len(raw)
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        body = decode_json(raw)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert full_text(body) == message(image(url(blob))) and len(raw) == size
    # (the check that a string is plain ASCII copies a slice or two of 1 MiB: 0.13x here)
    assert peak < 0.25 * size, f"parsing {size} bytes peaked at {peak / size:.2f}x more"


def test_a_cut_url_says_whether_spaces_surround_its_base64() -> None:
    """SGLang's strict decode refuses them (the gateway then sends the worker its own data URL: intake's
    _needs_rewrite)."""
    for payload, padded in ((BLOB, False), (" " + BLOB, True), (BLOB + "  ", True)):
        (cut,) = urls(decode_json(json.dumps(message(image(url(payload)))).encode()))
        assert isinstance(cut, CutURL) and cut.padded is padded
