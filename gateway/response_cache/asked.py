"""What a chat request asks, as the response cache keys it (:class:`Asked`).

    exact key     the whole request: every message with its text normalised (Unicode NFKC, runs of white space as
                  one space, no case folding: "K" and "k" are different fields), every image and video named by
                  its key (which names the pixels, the model, the processor settings and the namespace), and every
                  top-level field that can change the answer (all but ANSWER_NEUTRAL)
    context key   the same without the question: the conversation before its last turn, the last turn's role and
                  its images, and the fields. Paraphrases of a question are compared only within one context, so a
                  cached answer is never served after another conversation (the stale multi-turn reply)
    question      the last turn's text, normalised: what the sentence embedding and the guard read

``context_key(substitute)`` gives the context key with some images named by other keys: the ``similar`` level
looks for a context in which each image was its near-duplicate.

A request is cacheable only when it is deterministic (temperature 0, or a seed; unless settings allow any
sampling), asks for one choice, ends with a user turn that has text, and carries no session (its state lives in
the worker) and no logprobs (kept out of replayed streams); ``uncacheable`` says why not.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.intake import IntakeResult
from gateway.protocol import ImagePartRef, VideoPartRef, iter_media_parts

# Top-level fields that do not change what the model answers, only how it is delivered or accounted.
ANSWER_NEUTRAL = frozenset({"stream", "stream_options", "user", "store", "service_tier", "metadata",
                            "rid", "extra_key"})
_WHITE = re.compile(r"\s+")
# Why a request is not looked up or stored (the skipped counter's labels).
SAMPLING, CHOICES, NO_QUESTION, SESSION, LOGPROBS = "sampling", "choices", "no_question", "session", "logprobs"
SKIP_REASONS = (SAMPLING, CHOICES, NO_QUESTION, SESSION, LOGPROBS)


def normalise(text: str) -> str:
    return _WHITE.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def _digest(value: Any) -> str:
    return hashlib.blake2b(orjson.dumps(value, option=orjson.OPT_SORT_KEYS), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Asked:
    namespace: str
    exact_key: str
    question: str
    image_keys: tuple[str, ...]  # in prompt order
    uncacheable: str | None  # one of SKIP_REASONS, or None
    _fields: dict[str, Any] = field(repr=False)
    _history: list[Any] = field(repr=False)  # messages before the last, media as {"key": ...}
    _last: dict[str, Any] = field(repr=False)  # the last message without its text, media as {"key": ...}

    def context_key(self, substitute: dict[str, str] | None = None) -> str:
        skeleton: Any = {"fields": self._fields, "history": self._history, "last": self._last}
        if substitute:
            skeleton = _substituted(skeleton, substitute)
        return _digest({"namespace": self.namespace, **skeleton})

    @property
    def cacheable(self) -> bool:
        return self.uncacheable is None


def asked(intake: IntakeResult, *, any_sampling: bool = False) -> Asked:
    """What ``intake`` asks (see the module docstring)."""
    body = intake.upstream_body
    messages = body["messages"]
    keys: dict[tuple[int, int], str] = {}
    media = iter(intake.images)
    videos = iter(intake.videos)
    for ref in iter_media_parts(messages):  # the same order the intake resolved them in
        if isinstance(ref, ImagePartRef):
            keys[(ref.message_index, ref.part_index)] = next(media).key
        elif isinstance(ref, VideoPartRef):
            keys[(ref.message_index, ref.part_index)] = next(videos).key
    skeleton = [_message(i, message, keys) for i, message in enumerate(messages)]
    fields = {name: value for name, value in body.items() if name not in ANSWER_NEUTRAL and name != "messages"}
    last = dict(skeleton[-1])
    question = last.pop("text", "")
    exact_key = _digest({"namespace": intake.namespace, "fields": fields, "messages": skeleton})
    return Asked(namespace=intake.namespace, exact_key=exact_key, question=question,
                 image_keys=tuple(image.key for image in intake.images),
                 uncacheable=_uncacheable(body, last, question, any_sampling),
                 _fields=fields, _history=skeleton[:-1], _last=last)


def _message(index: int, message: dict[str, Any], keys: dict[tuple[int, int], str]) -> dict[str, Any]:
    """A message with its text parts joined and normalised under "text", its media named by key under "media"."""
    out = {name: value for name, value in message.items() if name != "content"}
    content = message.get("content")
    texts: list[str] = []
    media: list[Any] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if (index, j) in keys:
                media.append({"at": len(texts), "key": keys[(index, j)]})
            elif isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                media.append({"at": len(texts), "part": part})
    if content is None:
        out["content"] = None
    out["text"] = normalise(" ".join(texts))
    out["media"] = media
    return out


def _uncacheable(body: dict[str, Any], last: dict[str, Any], question: str, any_sampling: bool) -> str | None:
    if not any_sampling and body.get("temperature") != 0 and body.get("seed") is None:
        return SAMPLING
    if body.get("n", 1) != 1:
        return CHOICES
    if last.get("role") != "user" or not question:
        return NO_QUESTION
    if body.get("session_id") is not None or body.get("session_params") is not None:
        return SESSION
    if body.get("logprobs") or body.get("top_logprobs"):
        return LOGPROBS
    return None


def _substituted(value: Any, substitute: dict[str, str]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"at", "key"}:
            return {"at": value["at"], "key": substitute.get(value["key"], value["key"])}
        return {k: _substituted(v, substitute) for k, v in value.items()}
    if isinstance(value, list):
        return [_substituted(v, substitute) for v in value]
    return value
