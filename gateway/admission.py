"""Who may call, and how much they may have the gateway do at once: an ASGI middleware in front of ``/v1/...``.

For each request it:
1. identifies the caller from its API key (gateway/tenancy.py): an unknown key is refused (401) before a byte of
   the body is read;
2. admits it, or refuses it with OpenAI's 429 (``Retry-After: 1``) when the caller, or everyone together, already
   has ``max_requests`` requests or ``max_body_bytes`` of request bodies in flight (gateway.config.AdmissionLimits):
   one caller cannot take the gateway's memory, or its CPU for decoding and planning, from the others;
3. counts the body's bytes against both budgets as they arrive (a declared Content-Length is reserved before a byte
   of the body is read; a body larger than one request may ever send is a 413). A declared body that the key's
   budget has no room for yet waits for room, in the order the key's requests came, unread (its bytes stay in the
   client's socket, costing the gateway nothing), for up to ``body_timeout_s``: one key's large requests are taken
   in a few at a time, not refused. The key's budget is shared with the parses and decodings its requests have
   running on intake's pool (:meth:`Admission.share_budget_with`): while one of them fills it, the key's next body
   waits too. A chunked body that grows past a budget, and a body the whole gateway's budget has no room for, are
   a 429. A body not complete ``body_timeout_s`` after its reading began is a 408, however slowly it drips. A
   client that leaves while its body waits for room is not noticed before the wait ends (the server reports a
   disconnect only when asked for the body, and the client's FIN comes behind the body bytes it had sent): what
   it costs meanwhile is a place in its key's line, for ``body_timeout_s`` at most;
4. once the body is in, watches the connection: a client that leaves cancels its request wherever it is (taking
   in images, planning, waiting for a worker, streaming), and so the upstream request; the handler's own reads
   see the disconnect too.
What a request was admitted with is released when its response ends (a stream's last event) or it is cancelled,
and with it what the request took later (its turn at the workers, gateway/turns.py: ``Ticket.on_release``).
Everything here runs on the event loop: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from gateway.config import AdmissionLimits
from gateway.errors import ClientError, GatewayError
from gateway.tenancy import Caller

if TYPE_CHECKING:
    from gateway.pools import FairPool

ADMITTED_PREFIX = "/v1/"
RETRY_AFTER_S = 1

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class TooManyRequests(ClientError):
    """A caller (or everyone) has as much in flight as the gateway allows: OpenAI's 429, retried by its clients."""

    status_code = 429
    error_type = "requests"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="rate_limit_exceeded")


class RequestTooLarge(ClientError):
    """A body larger than any budget could take, however long the client waited: no retry helps."""

    status_code = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds {limit} bytes, the most one request may send",
                         code="request_too_large")


class BodyTimeout(ClientError):
    status_code = 408

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body did not arrive within {seconds:g} s", code="body_timeout")


class Admission:
    """The requests and body bytes in flight, overall and per caller (their key's id)."""

    def __init__(self, limits: AdmissionLimits, max_request_bytes: int) -> None:
        self.limits = limits
        # The most one request's body may hold: no budget takes more (REVISIT_MAX_REQUEST_BYTES, and the per-key one).
        self.most_per_request = min(max_request_bytes, limits.max_body_bytes_per_key)
        self.requests: Counter[str] = Counter()
        self.body_bytes: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # by reason: what /admin/stats shows
        self.waited = 0  # declared bodies that waited for room in their key's budget, ever
        self._total_requests = 0
        self._total_bytes = 0
        # key id -> its declared bodies waiting for room in its budget, in order: (size, granted when taken)
        self._waiting: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        # What a key's requests hold in the intake's pool (share_budget_with): its parses' and decodings' costs.
        self._working: Callable[[str], int] = lambda key_id: 0
        self._room_made: Callable[[], None] = lambda: None

    def share_budget_with(self, pool: FairPool) -> None:
        """One budget per key (``max_body_bytes_per_key``) for what its requests hold in memory: their bodies here
        and, in ``pool`` (intake's), the parses and decodings running for them. A declared body then waits for room
        while its key's parse or decoding fills the budget, and a parse or decoding waits while its key's bodies and
        other jobs do (or runs alone among the key's jobs: gateway/pools.py), so that one key's 50 MB body, as
        parsed, is not in memory beside its next body and its 40 Mpx image's decoding."""
        self._working, self._room_made = pool.cost_running, pool.room_made
        pool.share_caller_budget(self.held_bytes, self._wake)

    def held_bytes(self, key_id: str) -> int:
        """The body bytes the key's requests hold (called from the pool's threads too: one dict read)."""
        return self.body_bytes.get(key_id, 0)

    def _has_room(self, key_id: str, size: int) -> bool:
        """Whether the key's budget has room for a body of ``size`` beside its bodies and its jobs in the pool."""
        return self.body_bytes[key_id] + self._working(key_id) + size <= self.limits.max_body_bytes_per_key

    def admit(self, caller: Caller) -> Ticket:
        """A ticket for one more request of ``caller``; TooManyRequests when either budget is spent."""
        limits = self.limits
        if self.requests[caller.key_id] >= limits.max_requests_per_key:
            self.refused["requests_per_key"] += 1
            raise TooManyRequests(f"this API key has {limits.max_requests_per_key} requests in flight, as many as "
                                  "the gateway allows one key: retry when one has ended")
        if self._total_requests >= limits.max_requests:
            self.refused["requests"] += 1
            raise TooManyRequests("the gateway has as many requests in flight as it takes: retry shortly")
        self.requests[caller.key_id] += 1
        self._total_requests += 1
        return Ticket(self, caller.key_id)

    def _take_bytes(self, key_id: str, size: int) -> None:
        limits = self.limits
        if self.body_bytes[key_id] + size > limits.max_body_bytes_per_key:
            self.refused["body_bytes_per_key"] += 1
            raise TooManyRequests(f"this API key's requests in flight hold more than {limits.max_body_bytes_per_key}"
                                  " bytes of request bodies, as much as the gateway allows one key: retry when one "
                                  "has ended")
        if self._total_bytes + size > limits.max_body_bytes:
            self.refused["body_bytes"] += 1
            raise TooManyRequests("the gateway holds as many request bytes as it takes: retry shortly")
        self.body_bytes[key_id] += size
        self._total_bytes += size

    async def _take_bytes_in_turn(self, key_id: str, size: int, timeout_s: float) -> None:
        """Take ``size`` bytes of the key's budget when it has room, waiting for it in the key's order for up to
        ``timeout_s``; TooManyRequests when it had none in that time, or the whole gateway's budget has none."""
        queue = self._waiting.get(key_id)
        if not queue and self._has_room(key_id, size):
            self._take_bytes(key_id, size)
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key_id, deque()).append((size, granted))
        self.waited += 1
        try:
            async with asyncio.timeout(timeout_s):
                await granted
        except BaseException as exc:
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                if isinstance(exc, TimeoutError):
                    return  # room came as the time ran out: taken
                self._give_back_bytes(key_id, size)  # room came as the request was cancelled: given back
                raise
            self._withdraw(key_id, granted)
            if isinstance(exc, TimeoutError):
                self.refused["body_bytes_per_key"] += 1
                raise TooManyRequests(f"this API key's requests in flight held {self.limits.max_body_bytes_per_key}"
                                      f" bytes of request bodies, as much as the gateway allows one key, for the "
                                      f"{timeout_s:g} s this one waited: retry when fewer are in flight") from None
            raise

    def _withdraw(self, key_id: str, granted: asyncio.Future[None]) -> None:
        queue = self._waiting.get(key_id)
        if queue is not None:
            for entry in queue:
                if entry[1] is granted:
                    queue.remove(entry)
                    break
            if not queue:
                del self._waiting[key_id]
        self._wake(key_id)  # the next in line may fit where this one did not

    def _wake(self, key_id: str) -> None:
        """Take room for the key's waiting bodies that fit now, in order (a body the whole gateway's budget has no
        room for is refused there and then)."""
        queue = self._waiting.get(key_id)
        while queue and self._has_room(key_id, queue[0][0]):
            size, granted = queue.popleft()
            if granted.done():
                continue
            try:
                self._take_bytes(key_id, size)
            except TooManyRequests as exc:
                granted.set_exception(exc)
            else:
                granted.set_result(None)
        if queue is not None and not queue:
            del self._waiting[key_id]

    def _give_back_bytes(self, key_id: str, size: int) -> None:
        self.body_bytes[key_id] -= size
        self._total_bytes -= size
        if size:
            self._wake(key_id)
            self._room_made()

    def _release(self, key_id: str, size: int) -> None:
        self.requests[key_id] -= 1
        self._total_requests -= 1
        self._give_back_bytes(key_id, size)
        if not self.requests[key_id]:
            del self.requests[key_id], self.body_bytes[key_id]

    def stats(self) -> dict[str, Any]:
        return {"requests": self._total_requests, "body_bytes": self._total_bytes, "keys": len(self.requests),
                "waiting_for_room": sum(len(queue) for queue in self._waiting.values()), "waited": self.waited,
                "refused": dict(self.refused)}


class Ticket:
    """One admitted request: the body bytes it holds, given back once by :meth:`release`."""

    def __init__(self, admission: Admission, key_id: str) -> None:
        self._admission = admission
        self._key_id = key_id
        self.body_bytes = 0
        self._released = False
        self._on_release: list[Callable[[], None]] = []

    def on_release(self, call: Callable[[], None]) -> None:
        """Call ``call`` when the request's response has ended or it was cancelled (what it holds elsewhere)."""
        self._on_release.append(call)

    def hold(self, size: int) -> None:
        """Hold ``size`` more body bytes (TooManyRequests past a budget; RequestTooLarge past what one request
        may ever hold)."""
        self._check_size(size)
        self._admission._take_bytes(self._key_id, size)
        self.body_bytes += size

    async def hold_declared(self, size: int, timeout_s: float) -> None:
        """Hold a declared body's ``size`` bytes before it is read, waiting up to ``timeout_s`` for room in the
        key's budget (TooManyRequests when none came, or the whole gateway's budget has none; RequestTooLarge past
        what one request may ever hold)."""
        self._check_size(size)
        await self._admission._take_bytes_in_turn(self._key_id, size, timeout_s)
        self.body_bytes += size

    def _check_size(self, size: int) -> None:
        most = self._admission.most_per_request
        if self.body_bytes + size > most:
            self._admission.refused["request_too_large"] += 1
            raise RequestTooLarge(most)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self._key_id, self.body_bytes)
            for call in self._on_release:
                call()


class AdmissionMiddleware:
    """The middleware (module docstring); the app's ``state.services`` holds the Tenants and the Admission."""

    def __init__(self, app: Callable[[Message, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(ADMITTED_PREFIX):
            await self.app(scope, receive, send)
            return
        services = scope["app"].state.services
        try:
            caller = services.tenants.identify(scope_header(scope, b"authorization"))
            ticket = services.admission.admit(caller)
        except GatewayError as exc:
            await _refuse(send, exc)
            return
        try:
            declared = scope_header(scope, b"content-length")
            if declared is not None and declared.isdigit():
                await ticket.hold_declared(int(declared), services.admission.limits.body_timeout_s)
        except GatewayError as exc:
            ticket.release()
            await _refuse(send, exc)
            return
        except BaseException:
            ticket.release()
            raise
        scope.setdefault("state", {}).update(caller=caller, ticket=ticket)
        try:
            await _Connection(self.app, scope, receive, send, ticket, services.admission.limits).run()
        finally:
            ticket.release()
            services.memory.after(ticket.body_bytes)  # a large body's freed memory back to the system


class _Connection:
    """One admitted request's reads: its body counted and under a deadline, then a watch for the client leaving."""

    def __init__(self, app: Callable[[Message, Receive, Send], Awaitable[None]], scope: Message, receive: Receive,
                 send: Send, ticket: Ticket, limits: AdmissionLimits) -> None:
        self.app, self.scope, self._receive, self.send, self.ticket = app, scope, receive, send, ticket
        self._timeout_s = limits.body_timeout_s
        self._deadline = asyncio.get_running_loop().time() + limits.body_timeout_s
        self._declared = ticket.body_bytes  # held at admission from Content-Length
        self._received = 0
        self._body_done = False
        self._left = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        self._task = asyncio.ensure_future(self.app(self.scope, self.receive, self.send))
        try:
            await self._task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self._left.is_set() or (current is not None and current.cancelling()):
                raise  # the gateway is shutting down, not the client leaving
        finally:
            if self._watcher is not None:
                self._watcher.cancel()
            if not self._task.done():
                self._task.cancel()

    async def receive(self) -> Message:
        if self._body_done:
            await self._left.wait()
            return {"type": "http.disconnect"}
        remaining = self._deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):  # no task of its own, as wait_for would make
                message = await self._receive()
        except TimeoutError:
            raise BodyTimeout(self._timeout_s) from None
        if message["type"] == "http.disconnect":
            self._client_left()
            if asyncio.current_task() is self._task:
                await asyncio.sleep(0)  # the handler's own read: its cancellation lands here, not as a 500 later
            return message
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._declared:  # chunked, or more than declared: hold what came past it
                self.ticket.hold(self._received - self.ticket.body_bytes)
            if not message.get("more_body", False):
                self._body_done = True
                self._watcher = asyncio.ensure_future(self._watch())
        return message

    async def _watch(self) -> None:
        """After the body, the server's next message is the client leaving."""
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._client_left()
                return

    def _client_left(self) -> None:
        self._left.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()


def scope_header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """A request header's value from the ASGI scope (``name`` lowercase, as servers give them), without building
    Starlette's Headers for it."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _refuse(send: Send, exc: GatewayError) -> None:
    headers = [(b"content-type", b"application/json")]
    if isinstance(exc, TooManyRequests):
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    with contextlib.suppress(OSError):
        await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": orjson.dumps(exc.body())})
