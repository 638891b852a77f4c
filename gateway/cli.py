"""The ``revisit`` console command.

    revisit serve      the gateway plus N local SGLang workers (CPU or GPU), on a model
                       folder or the bundled model; progress while workers start, one
                       line when ready, workers stopped on exit
    revisit gateway    the gateway alone, in front of workers that run elsewhere
                       (settings from REVISIT_* variables, see GatewayConfig.from_env)
    revisit replay     replay a trace against a running gateway: report and plots (replay/)
    revisit trace      make a trace from real images, or import one of image hashes (replay/)
    revisit keys new   make an API key for a namespace, and its line for REVISIT_API_KEYS_FILE
    revisit keys secret  make the deployment secret the gateways and workers share (REVISIT_STORE_SECRET_FILE)
    revisit keys password  make the password of the books' Redis or Valkey server (REVISIT_BOOKS_PASSWORD_FILE)
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gateway.config import ConfigError, GatewayConfig


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--access-log", action="store_true",
                        help="log a line per request (off by default: at info level it took 15%% of the gateway's "
                             "CPU for a text request; revisit_requests_total counts them)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="revisit", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway with local SGLang workers")
    _add_server_args(serve)
    serve.add_argument("--model", default="bundled",
                       help="a Hugging Face style model folder, or 'bundled' (default) for the bundled model")
    serve.add_argument("--arch", default=None, help="bundled model architecture (qwen2_5_vl or qwen3_vl)")
    serve.add_argument("--size", default=None, help="bundled model size (tiny, bench, deep, reader or oracle)")
    serve.add_argument("--served-model-name", default=None, help="model id clients use (default: from the model)")
    serve.add_argument("--workers", type=int, default=1, help="number of local SGLang workers (default 1)")
    serve.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="worker device (default cpu)")
    serve.add_argument("--worker-port", type=int, default=30000,
                       help="port of the first worker; the others take the next ones (default 30000)")
    serve.add_argument("--log-dir", default=None, help="where worker logs go (default: a temporary folder)")
    serve.add_argument("--ready-timeout", type=float, default=900.0,
                       help="seconds to wait for the workers to become ready (default 900)")

    gateway = commands.add_parser("gateway", help="run the gateway alone (workers from REVISIT_WORKERS)")
    _add_server_args(gateway)

    keys = commands.add_parser("keys", help="API keys for REVISIT_API_KEYS_FILE")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    new_key = key_commands.add_parser("new", help="make a new API key for a namespace")
    new_key.add_argument("namespace", help="the cache namespace the key's requests belong to")
    new_key.add_argument("--append", metavar="FILE", default=None,
                         help="add the key's line (its digest, not the key) to this key file, created 0600")
    new_secret = key_commands.add_parser("secret", help="write a new deployment secret (32 random bytes) to FILE")
    new_secret.add_argument("file", help="where to write it, created 0600; an existing file is left alone")
    new_password = key_commands.add_parser(
        "password", help="write a new password (32 random bytes as hex) for the books' Redis or Valkey server to FILE")
    new_password.add_argument("file", help="where to write it, created 0600; an existing file is left alone")

    from replay.cli import add_commands

    add_commands(commands)
    return parser


def _run_gateway(
    config: GatewayConfig, host: str, port: int, log_level: str, on_ready: Callable[[], None] | None = None,
    access_log: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM; ``on_ready`` runs once the socket accepts requests."""
    import uvicorn

    from gateway.app import create_app

    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
                       timeout_keep_alive=max(1, round(config.keep_alive_s)), access_log=access_log)
    )

    def notify() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started and on_ready is not None:
            on_ready()

    threading.Thread(target=notify, name="ready-notifier", daemon=True).start()
    server.run()
    if not server.started:
        raise SystemExit(f"revisit: the gateway could not start on {host}:{port}")


def _new_key(namespace: str, append: str | None) -> int:
    """Print a new API key and its key-file line; with ``append``, add the line to that file."""
    import os
    import secrets

    from gateway.config import TenantSettings, key_digest

    key = "sk-revisit-" + secrets.token_urlsafe(32)
    try:
        TenantSettings.with_keys({key: namespace})
    except ConfigError as exc:
        print(f"revisit: {exc}", file=sys.stderr)
        return 2
    line = f"{namespace} sha256:{key_digest(key)}"
    if append is not None:
        fd = os.open(append, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as file:
            file.write(line + "\n")
        print(f"added to {append}: {line}", file=sys.stderr)
    else:
        print(f"line for REVISIT_API_KEYS_FILE: {line}", file=sys.stderr)
    print(key)
    return 0


def _new_secret(path: str) -> int:
    from settings.secret import DataPlaneSecret

    try:
        DataPlaneSecret.create(Path(path))
    except FileExistsError:
        print(f"revisit: {path} exists; it is left as it is (the deployment's entries are sealed under it)",
              file=sys.stderr)
        return 2
    print(f"revisit: wrote a new secret to {path}: give the same file to every gateway and worker as "
          "REVISIT_STORE_SECRET_FILE", file=sys.stderr)
    return 0


def _new_password(path: str) -> int:
    from settings.redis_auth import create_password

    try:
        create_password(Path(path))
    except FileExistsError:
        print(f"revisit: {path} exists; it is left as it is", file=sys.stderr)
        return 2
    print(f"revisit: wrote a new password to {path}: the books' server requires it, and every gateway and worker "
          "reads it (REVISIT_BOOKS_PASSWORD_FILE, REVISIT_STORE_OUTCOMES_PASSWORD_FILE)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "keys" and args.keys_command == "secret":
        return _new_secret(args.file)
    if args.command == "keys" and args.keys_command == "password":
        return _new_password(args.file)
    if args.command == "keys":
        return _new_key(args.namespace, args.append)
    if args.command in ("replay", "trace"):
        from replay.cli import run_command

        logging.basicConfig(level=logging.WARNING)
        return run_command(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    try:
        if args.command == "gateway":
            _run_gateway(GatewayConfig.from_env(), args.host, args.port, args.log_level, access_log=args.access_log)
            return 0
        from gateway.embedded import serve_embedded

        return serve_embedded(args, run_gateway=_run_gateway)
    except ConfigError as exc:
        print(f"revisit: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
