"""The trace format: JSON Lines, one request per line in arrival order, after an optional header line.

    {"trace": {"version": 1, "name": "docs-and-video", "made_by": "revisit trace make", ...}}
    {"t": 0.0, "tenant": "alice", "body": {"messages": [...], "max_tokens": 8}, "meta": {"family": "doc_scroll"}}
    {"t": 0.42, "tenant": "bob", "body": {...}}

- ``t``: seconds since the trace began, never decreasing.
- ``tenant``: who sent it. Each tenant is replayed under an API key of its own, so under a cache namespace of its
  own (two tenants share cached images only where the gateway's operator maps their keys to one namespace).
- ``body``: an OpenAI chat completion request; ``model`` is set when it is replayed. An image part's url is a
  ``data:`` URL, an http(s) URL, or a path relative to the trace file (``images/0001.png``), read and sent inline
  when the request is replayed.
- ``meta`` (optional): what the maker knows of the request (its workload family, its session), for the report.
"""

from __future__ import annotations

import base64
import json
import mimetypes
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1


class TraceError(ValueError):
    """A trace file that cannot be replayed, with the line that says why."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # its place in the trace, from 0
    t: float
    tenant: str
    body: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        line: dict[str, Any] = {"t": round(self.t, 6), "tenant": self.tenant, "body": self.body}
        if self.meta:
            line["meta"] = self.meta
        return json.dumps(line, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Trace:
    header: dict[str, Any]
    requests: tuple[TraceRequest, ...]
    base_dir: Path  # where relative image paths are found

    @property
    def duration_s(self) -> float:
        return self.requests[-1].t if self.requests else 0.0

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.tenant for r in self.requests))


def write_trace(path: Path, requests: Iterable[TraceRequest], **header: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        out.write(json.dumps({"trace": {"version": VERSION, **header}}) + "\n")
        for request in requests:
            out.write(request.to_json() + "\n")
    return path


def read_trace(path: Path) -> Trace:
    """Read and check a trace; a line that is not a request raises TraceError naming the line."""
    header: dict[str, Any] = {}
    requests: list[TraceRequest] = []
    last_t = 0.0
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from exc
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            line = json.loads(text)
        except ValueError as exc:
            raise TraceError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(line, dict):
            raise TraceError(f"{where}: a trace line must be a JSON object")
        if "trace" in line and not requests and not header:
            header = line["trace"] if isinstance(line["trace"], dict) else {}
            if header.get("version", VERSION) != VERSION:
                raise TraceError(f"{where}: trace version {header.get('version')!r}; this reads version {VERSION}")
            continue
        t, tenant, body = line.get("t"), line.get("tenant"), line.get("body")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
            raise TraceError(f"{where}: t must be a number of seconds >= 0")
        if t < last_t:
            raise TraceError(f"{where}: t goes back in time ({t} after {last_t})")
        if not isinstance(tenant, str) or not tenant:
            raise TraceError(f"{where}: tenant must be a non-empty string")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise TraceError(f"{where}: body must be a chat request with a non-empty messages list")
        meta = line.get("meta") or {}
        if not isinstance(meta, dict):
            raise TraceError(f"{where}: meta must be an object")
        last_t = float(t)
        requests.append(TraceRequest(index=len(requests), t=float(t), tenant=tenant, body=body, meta=meta))
    if not requests:
        raise TraceError(f"{path}: the trace holds no request")
    return Trace(header=header, requests=tuple(requests), base_dir=path.parent)


def image_parts(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The image_url objects of a body's messages, in order."""
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"),
                                                                                              dict):
                    yield part["image_url"]


class ImageFiles:
    """Trace-relative image paths as data: URLs, read once and kept (an LRU of ``budget`` bytes of URLs)."""

    def __init__(self, base_dir: Path, budget: int = 512 * 1024 * 1024) -> None:
        self._base = base_dir.resolve()
        self._budget = budget
        self._urls: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0

    def inline(self, body: dict[str, Any]) -> dict[str, Any]:
        """A copy of body with every trace-relative image path replaced by the file's data: URL."""
        copied = json.loads(json.dumps(body))
        for image in image_parts(copied):
            url = image.get("url")
            if isinstance(url, str) and not url.startswith(("data:", "http://", "https://")):
                image["url"] = self.data_url(url)
        return copied

    def data_url(self, relative: str) -> str:
        if (known := self._urls.get(relative)) is not None:
            self._urls.move_to_end(relative)
            return known
        path = (self._base / relative).resolve()
        if not path.is_relative_to(self._base):
            raise TraceError(f"image path {relative!r} leaves the trace's folder")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TraceError(f"image {relative!r}: {exc}") from exc
        mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        url = f"data:{mime};base64," + base64.b64encode(data).decode()
        self._urls[relative] = url
        self._bytes += len(url)
        while self._bytes > self._budget and len(self._urls) > 1:
            _, dropped = self._urls.popitem(last=False)
            self._bytes -= len(dropped)
        return url
