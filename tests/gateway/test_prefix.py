"""Prefix digests: equal exactly when everything before an image is the same."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.intake import prefix_digests
from gateway.protocol import iter_media_parts


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def digests(body: dict, keys: dict[str, str]) -> tuple[str, ...]:
    refs = list(iter_media_parts(body["messages"]))
    return prefix_digests(body, refs, [SimpleNamespace(key=keys[ref.url]) for ref in refs])


KEYS = {"a": "a" * 64, "b": "b" * 64, "a2": "a" * 64}  # a2: another URL of the same pixels


def chat(*content, system: str | None = None, **extra) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": list(content)})
    return {"model": "m", "messages": messages, **extra}


def test_what_follows_an_image_does_not_change_its_prefix() -> None:
    first = digests(chat({"type": "text", "text": "Look:"}, image("a"), {"type": "text", "text": "What is it?"}), KEYS)
    second = digests(chat({"type": "text", "text": "Look:"}, image("a"), {"type": "text", "text": "Colours?"}), KEYS)
    assert first == second and len(first) == 1


def test_same_pixels_under_another_url_keep_the_prefix() -> None:
    one = digests(chat(image("a"), image("b")), KEYS)
    other = digests(chat(image("a2"), image("b")), KEYS)
    assert one == other


def test_anything_before_the_image_changes_the_prefix() -> None:
    base = digests(chat({"type": "text", "text": "Look:"}, image("a")), KEYS)[0]
    variants = [
        chat({"type": "text", "text": "Look here:"}, image("a")),
        chat({"type": "text", "text": "Look:"}, image("a"), system="Be brief."),
        chat({"type": "text", "text": "Look:"}, image("a"), tools=[{"type": "function", "function": {"name": "f"}}]),
        {"model": "m", "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                                    {"role": "user", "content": [{"type": "text", "text": "Look:"}, image("a")]}]},
    ]
    assert all(digests(body, KEYS)[0] != base for body in variants)


def test_a_later_image_depends_on_the_earlier_image() -> None:
    ab = digests(chat(image("a"), image("b")), KEYS)
    bb = digests(chat(image("b"), image("b")), KEYS)
    assert ab[0] == bb[0] and ab[1] != bb[1]  # nothing before the first; the second follows a or b
    assert digests({"model": "m", "messages": [{"role": "user", "content": "no images"}]}, KEYS) == ()
