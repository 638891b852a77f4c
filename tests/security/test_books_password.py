"""The books' Redis or Valkey server takes only clients that know its password. The server here is started as
compose.scale-out.yaml starts Valkey (its password written from the secret file into a config file), with Debian's
redis-server in Valkey's place. A gateway given the password file joins the books, and a worker's outcomes reach
it; one without it, or with another password, is refused with an error that says so, and no message, log line,
config repr or admin answer shows the password."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.books import BookLog, BooksMismatch, BooksUnavailable, SharedFeatureStore
from gateway.cli import main
from gateway.config import ConfigError, GatewayConfig
from launcher import WorkerSpec
from launcher.launch import build_launch
from plan.outcome import Outcome, SharedOutcomeBox, outcome_box
from settings.redis_auth import RedisPasswordError, RedisURL, create_password, masked, read_password, with_password
from store import StoreConfig
from store.errors import ConfigError as StoreConfigError
from tests.conftest import MODEL_ID, free_port, start_gateway_process, terminate
from tests.test_compose import SCALE_OUT, compose_file

PASSWORD = "0123456789abcdef" * 4


def test_a_url_with_a_password_is_shown_masked_however_it_is_printed(caplog):
    url = RedisURL("redis://:s3cret%40x@10.0.0.5:6379/0")
    assert str.__str__(url) == "redis://:s3cret%40x@10.0.0.5:6379/0"  # what redis-py is given
    as_logged = "%s" % url  # noqa: UP031 (as logging formats it)
    as_formatted = "{}".format(url)  # noqa: UP032 (str.format's way)
    for shown in (str(url), repr(url), f"{url}", f"{url:>40}", as_logged, as_formatted, url.shown, str([url])):
        assert "s3cret" not in shown and "***" in shown
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("books at %s (%r)", url, url)
    assert "s3cret" not in caplog.text and "redis://:***@10.0.0.5:6379/0" in caplog.text
    assert masked("redis://user:pw@h:1/2?password=pw&db=2") == "redis://user:***@h:1/2?password=***&db=2"
    assert masked("unix://:pw@/run/valkey.sock") == "unix://:***@/run/valkey.sock"
    assert masked("redis://h:6379/0") == "redis://h:6379/0"  # nothing to mask
    assert str.__str__(RedisURL(url)) == str.__str__(url)  # a RedisURL of a RedisURL keeps the text


def test_a_password_file_is_put_into_the_url_and_stays_out_of_every_repr_and_error(tmp_path):
    secret = tmp_path / "books-password"
    assert main(["keys", "password", str(secret)]) == 0  # create_password
    assert secret.stat().st_mode & 0o777 == 0o600 and len(read_password(secret)) == 64
    made = secret.read_text()
    assert main(["keys", "password", str(secret)]) == 2 and secret.read_text() == made  # left as it is
    with pytest.raises(FileExistsError):
        create_password(secret)
    password = read_password(secret)
    url = with_password("redis://10.0.0.5:6379/0", secret)
    import redis

    assert redis.connection.parse_url(url)["password"] == password
    assert password not in str(url) and password not in repr(url)
    # the same, through the settings of a gateway and of a worker
    env = {"REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://w:1", "REVISIT_AUTH": "open", "REVISIT_REUSE": "1",
           "REVISIT_STORE_TIERS": "dram", "REVISIT_STORE_DRAM_DIR": str(tmp_path / "dram"),
           "REVISIT_BOOKS_URL": "redis://10.0.0.5:6379/0", "REVISIT_BOOKS_PASSWORD_FILE": str(secret),
           "REVISIT_STORE_OUTCOMES_URL": "redis://10.0.0.5:6379/0",
           "REVISIT_STORE_OUTCOMES_PASSWORD_FILE": str(secret)}
    config = GatewayConfig.from_env(env)
    store = config.reuse.store
    assert store is not None
    for address in (config.books_address, store.outcomes_address):
        assert redis.connection.parse_url(address)["password"] == password
    assert password not in repr(config) and password not in repr(store)
    # A file that cannot serve is refused at start, naming the file, never what it holds.
    (tmp_path / "spaced").write_text("two words\n")
    for broken, why in ((tmp_path / "absent", "cannot read"), (tmp_path / "spaced", "printable")):
        with pytest.raises(ConfigError, match=why) as refused:
            GatewayConfig.from_env({**env, "REVISIT_BOOKS_PASSWORD_FILE": str(broken)})
        assert str(broken) in str(refused.value) and "two words" not in str(refused.value)
        with pytest.raises(ConfigError, match=why):
            GatewayConfig.from_env({**env, "REVISIT_STORE_OUTCOMES_PASSWORD_FILE": str(broken)})
    with pytest.raises(RedisPasswordError, match="give it once") as twice:
        with_password("redis://:inline-one@h:6379/0", secret)
    assert "inline-one" not in str(twice.value)
    # A worker's launch reads the outcomes' password file too: one that cannot serve stops it before SGLang starts.
    with pytest.raises(RedisPasswordError, match="printable"):
        build_launch(WorkerSpec(model_path=tmp_path), base_env={
            "PATH": "/usr/bin", "REVISIT_STORE_OUTCOMES_PASSWORD_FILE": str(tmp_path / "spaced")})
    argv, _ = build_launch(WorkerSpec(model_path=tmp_path), base_env={
        "PATH": "/usr/bin", "REVISIT_STORE_OUTCOMES_PASSWORD_FILE": str(secret)})
    assert password not in " ".join(argv)
    with pytest.raises(ConfigError, match="without books_url"):
        GatewayConfig.from_env({k: v for k, v in env.items() if k != "REVISIT_BOOKS_URL"})
    with pytest.raises(StoreConfigError, match="without outcomes_url"):
        StoreConfig(outcomes_password_file=secret)
    # an inline password (in the URL itself) is masked too, and survives a copy of the config
    inline = dataclasses.replace(store, outcomes_url="redis://:inline-two@h:6379/0", outcomes_password_file=None)
    assert "inline-two" not in repr(inline) and "inline-two" in str.__str__(inline.outcomes_address)


def _wait_until_it_answers(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith((b"-NOAUTH", b"+PONG")):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError(f"the books' server did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The Valkey service's own start command (compose.scale-out.yaml), run with redis-server in its place on
    loopback: (its URL, without a password; the password file)."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed (make test installs Debian's)")
    folder = tmp_path_factory.mktemp("books-server")
    secret = folder / "books-password"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o600)
    script = compose_file({"CLUSTER_ADDRESS": "127.0.0.1"}, SCALE_OUT)["services"]["valkey"]["command"]
    assert script[:2] == ["sh", "-c"]
    script = script[2]
    port = free_port()
    for theirs, ours in (("/run/secrets/books_password", str(secret)), ("/tmp/auth.conf", str(folder / "auth.conf")),
                         ("chown valkey", "true"), ("exec docker-entrypoint.sh valkey-server", "exec redis-server")):
        assert theirs in script
        script = script.replace(theirs, ours)
    script += f" --port {port} --bind 127.0.0.1 --dir {folder}"
    log = folder / "server.log"
    process = subprocess.Popen(["sh", "-c", script], stdout=open(log, "wb"),  # noqa: SIM115 (the child's)
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_it_answers(port, process, log)
        assert PASSWORD not in str(process.args)  # not on its command line
        assert (folder / "auth.conf").stat().st_mode & 0o777 == 0o600
        yield f"redis://127.0.0.1:{port}/0", secret
    finally:
        terminate(process)


def test_clients_with_the_password_file_use_the_books_and_others_are_refused_clearly(locked_server, tmp_path):
    url, secret = locked_server
    name = f"test-{uuid.uuid4().hex[:12]}"
    address = with_password(url, secret)
    books = BookLog(address, name=name)
    books.check_settings("fingerprint")
    books.append({"kind": "test"})
    assert books.length() == 1
    features = SharedFeatureStore(address, name=name)
    features.put("a" * 64, b"index", b"tokens")
    assert features.tokens("a" * 64) == b"tokens"
    # A worker leaves an outcome through its store settings; the gateway takes it.
    worker = StoreConfig(tiers=("dram",), dram_dir=tmp_path / "dram", outcomes_url=url, outcomes_password_file=secret)
    outcome_box(worker.outcomes_path, worker.outcomes_address, name=name).put("r1", {0: Outcome("planned")})
    assert SharedOutcomeBox(address, name=name).take("r1") == {0: Outcome("planned")}
    # Without the password, or with another one: refused, and saying why.
    wrong = tmp_path / "wrong"
    wrong.write_text("f" * 64)
    for client, why in ((BookLog(url, name=name), "(?i)authenticated"),
                        (BookLog(with_password(url, wrong), name=name), "invalid username-password")):
        with pytest.raises(BooksUnavailable, match=why) as refused:
            client.length()
        assert PASSWORD not in str(refused.value) and "f" * 64 not in str(refused.value)
    assert SharedOutcomeBox(url, name=name).take("r2") is None  # a gateway's read: nothing, not a crash
    with pytest.raises(OSError, match="could not leave the outcome"):
        SharedOutcomeBox(url, name=name).put("r2", {0: Outcome("planned")})
    # An error that names the server shows it masked.
    with pytest.raises(BooksMismatch) as mismatch:
        BookLog(address, name=name).check_settings("other settings")
    assert "***" in str(mismatch.value) and PASSWORD not in str(mismatch.value)


def test_a_gateway_joins_the_books_with_the_password_file_and_without_it_does_not_start(locked_server, model_path,
                                                                                         tmp_path):
    url, secret = locked_server
    env = {"REVISIT_MODEL": MODEL_ID, "REVISIT_WORKERS": "http://127.0.0.1:9", "REVISIT_MODEL_DIR": str(model_path),
           "REVISIT_STORE_NAME": f"test-{uuid.uuid4().hex[:12]}", "REVISIT_STORE_TIERS": "dram",
           "REVISIT_STORE_DRAM_DIR": str(tmp_path / "dram"), "REVISIT_STORE_PIN_HOST_MEMORY": "0",
           "REVISIT_STORE_OUTCOMES_URL": url, "REVISIT_STORE_OUTCOMES_PASSWORD_FILE": str(secret),
           "REVISIT_BOOKS_URL": url, "REVISIT_BOOKS_PASSWORD_FILE": str(secret),
           "REVISIT_ADMIN_TOKEN": "admin-token-books-password"}
    port, log = free_port(), tmp_path / "gateway.log"
    up = lambda response: response.status_code in (200, 503)  # noqa: E731 (serving; its one worker is away)
    process = start_gateway_process(env, port, log_file=log, ready=up)
    try:
        stats = httpx.get(f"http://127.0.0.1:{port}/admin/stats", timeout=10,
                          headers={"Authorization": "Bearer admin-token-books-password"})
        assert stats.status_code == 200 and stats.json()["books"]["shared"] is True
        assert PASSWORD not in stats.text
    finally:
        terminate(process)
    assert PASSWORD not in log.read_text(errors="replace")
    # Without the password file: the gateway stops at start, and its log says why.
    refused_log = tmp_path / "refused.log"
    without = {k: v for k, v in env.items() if k != "REVISIT_BOOKS_PASSWORD_FILE"}
    with pytest.raises(AssertionError, match="exited"):
        terminate(start_gateway_process(without, free_port(), log_file=refused_log, ready=up, timeout=120))
    said = refused_log.read_text(errors="replace")
    assert "BooksUnavailable" in said and "refused this gateway's password" in said and PASSWORD not in said
    assert "REVISIT_BOOKS_PASSWORD_FILE" in said
