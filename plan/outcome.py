"""What a worker actually ran for each planned image, reported back to the gateway.

A plan is what the gateway intends; a worker may have to do otherwise (the entry gone or damaged since it was
planned, an alias that cannot be read mid-forward, a prompt split over chunks). For each request it executed a
plan for, the worker writes an ``Outcome`` per image into a folder both share on the host (the store's host:
gateway and workers already share its shared-memory tier), named by the gateway's request id. The worker writes it
during the prefill, before the first token leaves, so the gateway finds it once the worker's first event (a stream)
or whole answer has come back, reads it and removes it (``OutcomeBox.take``). What the gateway then reports
(``x-revisit-reuse``, its metrics and log) is what ran, not what was planned.

Per image, ``ran`` is one of

    planned       the plan ran as written (``cause`` None), or with some rows computed instead of reused
                  (``cause`` "kv_read_failed": their stored K/V could not be read mid-forward; a partial vision
                  pass that could not run gives "vision_partial_failed", the full pass having run instead)
    prefix_cached SGLang's prefix cache held every row of the image already (computed there as a full prefill
                  computes them, by an earlier request): nothing was executed or read for it
    full_prefill  the image was computed as after a miss; ``cause`` says why (CAUSES)
    unplanned     the worker ran the request without a plan (a damaged or foreign one, or images that did not fit)

Files are a few hundred bytes, written atomically (a temporary name, then a rename); a gateway that died before
taking its outcomes leaves them to ``sweep``. Like the DRAM tier's, the folder is this user's alone (0700, files
0600; gateway and workers run as one user): an existing one that is a symbolic link, another user's, or writable by
group or others is refused (a worker's ``put`` raises PermissionError, the gateway's ``take`` finds nothing), and
one of ours that others may read (earlier versions made it 0755) is tightened.

Across hosts (a gateway in front of workers on other hosts) the folder cannot be shared: ``SharedOutcomeBox`` keeps
the same records in a Redis or Valkey server instead (``REVISIT_STORE_OUTCOMES_URL``, the server of the gateways'
shared books), each with an expiry that does what ``sweep`` does for files, and each behind a MAC (keyed BLAKE3
under the deployment secret's "outcomes" key, settings/secret.py) over the box's prefix, the request id and the
record: a record that someone with access to the server placed there, or copied from another request or store, is
ignored (the gateway then reports what it planned, as when a worker reports nothing). ``outcome_box`` picks one by
the store settings.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from settings.folders import FILE_MODE, private_folder
from settings.secret import DataPlaneSecret, mac, same_mac

log = logging.getLogger(__name__)

PLANNED, PREFIX_CACHED, FULL_PREFILL, UNPLANNED = "planned", "prefix_cached", "full_prefill", "unplanned"
RAN = (PLANNED, PREFIX_CACHED, FULL_PREFILL, UNPLANNED)
EVERY_IMAGE = -1  # the index of an outcome that holds for every image of the request (a refused plan)
CAUSES = {
    "entry_missing": "the entry (or an approximate plan's alias) is not in the store",
    "entry_damaged": "the entry is in the store but fails verification",
    "entry_foreign": "the entry was made by another model or for an image of another size",
    "not_movable": "the entry does not move as a whole to this prompt's positions",
    "store_error": "the store could not be read",
    "chunked": "a cacheblend plan's image was split over extends (chunked prefill): it ranks the whole image",
    "kv_read_failed": "stored K/V could not be read mid-forward",
    "vision_partial_failed": "the partial vision pass could not run; the full pass ran",
    "plan_refused": "the request id carried a damaged plan or one of an unknown version",
    "plan_mismatch": "the plan did not fit the request's images",
}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAC_BYTES = 32

# The other thing workers report: when their model's last forward started and ended (Unix seconds), as gauges on
# their /metrics (engine_ext.executor.events.ForwardClock), which the gateway reads to tell busy from hung.
FORWARD_STARTED = "revisit_worker_forward_started_seconds"
FORWARD_ENDED = "revisit_worker_forward_ended_seconds"


@dataclass(frozen=True)
class Outcome:
    ran: str
    cause: str | None = None

    def __post_init__(self) -> None:
        if self.ran not in RAN:
            raise ValueError(f"unknown outcome {self.ran!r}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}")

    @property
    def fell_back(self) -> bool:
        """The image was computed as after a miss (its plan not run, nor needed: not prefix_cached)."""
        return self.ran not in (PLANNED, PREFIX_CACHED)


class OutcomeBox:
    """The shared folder of outcomes; the worker ``put``s, the gateway ``take``s."""

    # A take reads and removes one small file in shared memory (tens of microseconds): the gateway calls it on its
    # event loop, where a hop to a thread would cost more than the read (a whole scheduling delay on a busy host).
    blocking = False

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def put(self, request_id: str, outcomes: dict[int, Outcome]) -> None:
        """Per image index, what ran; replaces what an earlier chunk of the same request wrote."""
        target = self.path / _name(request_id)
        _private_folder(self.path, create=True)
        temporary = self.path / f".{target.name}.{os.getpid()}"
        body = json.dumps({str(i): [o.ran, o.cause] for i, o in sorted(outcomes.items())}).encode()
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
        with open(fd, "wb", closefd=True) as f:
            f.write(body)
        os.replace(temporary, target)

    def take(self, request_id: str) -> dict[int, Outcome] | None:
        """What the worker wrote for the request, removed; None when it wrote nothing (or something unreadable)."""
        target = self.path / _name(request_id)
        try:
            _private_folder(self.path, create=False)
            text = target.read_text()
            target.unlink()
            return {int(i): Outcome(ran, cause) for i, (ran, cause) in json.loads(text).items()}
        except (OSError, ValueError, TypeError):
            return None

    def sweep(self, older_than_s: float = 600.0) -> int:
        """Remove outcomes nobody took (their gateway died); returns how many."""
        removed, now = 0, time.time()
        try:
            _private_folder(self.path, create=False)
            children = list(self.path.iterdir())
        except OSError:
            return 0
        for child in children:
            try:
                if now - child.stat().st_mtime > older_than_s:
                    child.unlink()
                    removed += 1
            except OSError:
                continue
        return removed


class SharedOutcomeBox:
    """Outcomes in a Redis or Valkey server: ``outcome:<request id>`` under the store's prefix, expiring after
    ``expire_s``. The same interface as OutcomeBox; one round trip per call."""

    blocking = True  # a network round trip: called off the event loop

    def __init__(self, url: str, *, name: str, expire_s: int = 600, timeout_s: float = 2.0,
                 secret: DataPlaneSecret | None = None) -> None:
        import redis  # only where outcomes cross hosts

        self.prefix = f"revisit:{name}:outcome:"
        self.expire_s = expire_s
        self.refused = 0  # records ignored: their MAC was missing or wrong
        self._mac_key = (secret if secret is not None else DataPlaneSecret()).key("outcomes")
        self._errors = (redis.RedisError,)
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _mac(self, request_id: str, body: bytes) -> bytes:
        return mac(self._mac_key, b"revisit-outcome", self.prefix.encode(), request_id.encode(), body)

    def put(self, request_id: str, outcomes: dict[int, Outcome]) -> None:
        body = json.dumps({str(i): [o.ran, o.cause] for i, o in sorted(outcomes.items())}).encode()
        name = _name(request_id)
        try:
            self._redis.set(self.prefix + name, self._mac(name, body) + body, ex=self.expire_s)
        except self._errors as exc:
            raise OSError(f"could not leave the outcome of {request_id}: {exc}") from exc

    def take(self, request_id: str) -> dict[int, Outcome] | None:
        """What a worker wrote for the request, removed; None when nothing was written, or the record is not
        authenticated (counted), or the server did not answer. A blocking round trip: call it off the event loop."""
        try:
            name = _name(request_id)
            value = self._redis.getdel(self.prefix + name)
            if value is None:
                return None
            data = bytes(value)  # type: ignore[arg-type]
            tag, body = data[:_MAC_BYTES], data[_MAC_BYTES:]
            if len(tag) < _MAC_BYTES or not same_mac(self._mac(name, body), tag):
                self.refused += 1
                if self.refused == 1:
                    log.warning("an outcome in %s was not authenticated (forged, copied from another request or "
                                "store, made under another secret or by a version that did not authenticate them): "
                                "ignored; further ones are counted, not logged", self.prefix)
                return None
            return {int(i): Outcome(ran, cause) for i, (ran, cause) in json.loads(body).items()}
        except (*self._errors, ValueError, TypeError):
            return None

    def sweep(self, older_than_s: float = 600.0) -> int:
        """Nothing to do: records expire on their own."""
        return 0


Outcomes = OutcomeBox | SharedOutcomeBox  # either box: the same interface


def outcome_box(outcomes_path: Path, outcomes_url: str = "", *, name: str = "default",
                secret: DataPlaneSecret | None = None) -> Outcomes:
    """The box the store settings name: a Redis server when ``outcomes_url`` is set (its records authenticated under
    ``secret``; None: a public key), else the host's folder."""
    return SharedOutcomeBox(outcomes_url, name=name, secret=secret) if outcomes_url else OutcomeBox(outcomes_path)


def _private_folder(path: Path, *, create: bool) -> None:
    """The box's folder made (``create``) or checked private (settings/folders.py): PermissionError when it is not
    one only this user can use; without ``create`` a missing one raises FileNotFoundError."""
    private_folder(path, what="the outcomes folder", create=create)


def _name(request_id: str) -> str:
    if not _NAME.fullmatch(request_id):
        raise ValueError(f"not a request id: {request_id[:80]!r}")
    return request_id
