"""Worker health as the pool sees it, against real HTTP servers on loopback."""

import threading
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from gateway.errors import NoHealthyWorker
from gateway.workers import WorkerPool
from tests.conftest import free_port
from tests.http_server import serve_handler


class SlowHealth(BaseHTTPRequestHandler):
    """Answers /health at once, or, while ``answer`` is clear, only once it is set again (a worker busy with a
    long prefill): a check then times out whatever the machine's speed, and setting it lets the answers go.
    /metrics waits the same way unless ``metrics_answer`` (the HTTP process of a worker whose scheduler is busy
    still answers it; one that is stopped answers nothing)."""

    answer: threading.Event
    metrics_answer = False

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if not (self.path == "/metrics" and self.metrics_answer):
            type(self).answer.wait(timeout=60)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def slow_health(metrics_answer: bool = False):
    answer = threading.Event()
    answer.set()
    return type("Handler", (SlowHealth,), {"answer": answer, "metrics_answer": metrics_answer}), answer


async def test_a_slow_health_answer_does_not_take_a_worker_out_at_once():
    handler, answer = slow_health()
    with serve_handler(handler) as url:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool([url], client, interval_s=3600, timeout_s=0.2, misses_allowed=3)
            await pool.check_all()
            assert pool.ready
            answer.clear()
            for _ in range(2):
                await pool.check_all()
                assert pool.ready, "two slow answers in a row must not take the worker out"
            await pool.check_all()
            assert not pool.ready and pool.workers[0].missed_checks == 3
            answer.set()  # the held answers go out; the next check is answered at once
            await pool.check_all()
            assert pool.ready and pool.workers[0].missed_checks == 0


async def test_a_worker_with_requests_in_flight_is_not_taken_out_for_slow_health_answers():
    handler, answer = slow_health(metrics_answer=True)
    with serve_handler(handler) as url:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool([url], client, interval_s=3600, timeout_s=0.2, misses_allowed=2)
            await pool.check_all()
            answer.clear()
            async with pool.lease(pool.workers[0]):  # a request in flight
                for _ in range(4):
                    await pool.check_all()
                assert pool.ready and pool.workers[0].missed_checks == 4
            await pool.check_all()  # idle again, still slow: out
            assert not pool.ready
            answer.set()


async def test_a_worker_that_answers_nothing_is_taken_out_even_with_requests_in_flight():
    """Stopped (SIGSTOP, swapped out): neither /health nor /metrics answers, so its requests in flight do not
    keep it in rotation, where it would take new requests that wait as long as it hangs."""
    handler, answer = slow_health(metrics_answer=False)
    with serve_handler(handler) as url:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool([url], client, interval_s=3600, timeout_s=0.2, misses_allowed=2)
            await pool.check_all()
            answer.clear()
            async with pool.lease(pool.workers[0]):
                await pool.check_all()
                assert pool.ready, "one unanswered check is not yet a hang"
                await pool.check_all()
                assert not pool.ready and pool.workers[0].missed_checks == 2
            answer.set()


async def test_nothing_listening_takes_a_worker_out_at_once():
    async with httpx.AsyncClient() as client:
        pool = WorkerPool([f"http://127.0.0.1:{free_port()}"], client, interval_s=3600, timeout_s=1)
        pool.workers[0].healthy = True
        await pool.check_all()
        assert not pool.ready and "ConnectError" in pool.workers[0].last_error


class Restartable(BaseHTTPRequestHandler):
    """A worker whose /health fails while ``down`` and whose /v1/models reports ``context`` as max_model_len."""

    down = False
    context = 4096

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        cls = type(self)
        if self.path == "/v1/models":
            body = ('{"object": "list", "data": [{"id": "m", "object": "model", "root": "/models/m", '
                    f'"max_model_len": {cls.context}}}]}}').encode()
        else:
            body = b""
        self.send_response(503 if cls.down and self.path == "/health" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


async def test_the_model_card_is_read_again_when_a_worker_comes_back():
    handler = type("Handler", (Restartable,), {})
    with serve_handler(handler) as url:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool([url], client, interval_s=3600, timeout_s=1.0, misses_allowed=1)
            await pool.check_all()
            assert pool.workers[0].model_card["max_model_len"] == 4096
            handler.down, handler.context = True, 8192  # restarted with a longer context
            await pool.check_all()
            assert not pool.ready and pool.workers[0].model_card["max_model_len"] == 4096  # the last one known
            handler.down = False
            await pool.check_all()
            assert pool.ready and pool.workers[0].model_card["max_model_len"] == 8192


async def test_with_no_healthy_worker_a_silent_one_is_the_last_resort():
    """The worker left alone with the load while the other restarts misses its checks and is taken out: requests
    still go to it (it may answer late) rather than failing at once; a worker where nothing listens never takes them,
    and a request sent to a worker already out is not taken back by the checks that follow."""
    handler, answer = slow_health(metrics_answer=False)
    with serve_handler(handler) as url:
        async with httpx.AsyncClient() as client:
            dead = f"http://127.0.0.1:{free_port()}"
            pool = WorkerPool([dead, url], client, interval_s=3600, timeout_s=0.2, misses_allowed=2)
            await pool.check_all()
            silent = pool.workers[1]
            assert pool.ready and not silent.silent
            answer.clear()
            for _ in range(2):
                await pool.check_all()
            assert not pool.ready and silent.silent and not pool.workers[0].silent
            assert pool.choose() is silent and pool.last_resort_sent == 1
            with pytest.raises(NoHealthyWorker):
                pool.choose(exclude=[silent])  # the dead one is never a last resort
            with pool.until_taken_out(silent) as waiting:
                await pool.check_all()  # out already: what was sent knowing stays
            assert not waiting.cancel_called
            answer.set()
            await pool.check_all()
            assert pool.ready and not silent.silent
            assert pool.choose() is silent and pool.last_resort_sent == 1  # healthy again: no last resort counted


async def test_a_worker_answering_its_checks_with_an_error_is_no_last_resort():
    handler = type("Handler", (Restartable,), {"down": True})
    with serve_handler(handler) as url:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool([url], client, interval_s=3600, timeout_s=1.0, misses_allowed=1)
            await pool.check_all()
            assert not pool.ready and not pool.workers[0].silent
            with pytest.raises(NoHealthyWorker):
                pool.choose()
